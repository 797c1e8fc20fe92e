"""Reading pickles safely: with torch (``unpickle``, its fast road ``fast_unpickle``) and
without it, for the operator CLI (``state_replay``, ``metadata_scan``, ``pickle_scan``),
against one set of allow-lists (``allowlists``). Only ``unpickle`` and ``fast_unpickle``
import torch.
"""
