"""Reading pickles safely, against one set of allow-lists; only ``unpickle`` and
``fast_unpickle`` import torch (the rest serve the CLI).
"""
