"""Reading pickles safely, against one allow-list (``allowlists``), on two roads: the opcode
walk (``check``, no torch) then C pickle, or torch's weights-only loader; only ``unpickle``
imports torch (the rest serve the CLI too).
"""
