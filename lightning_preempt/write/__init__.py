"""Writing one checkpoint, on the writer thread, ending with its commit.

The job queue (the writer thread, ``jobs``), the commit protocol (``commit``), replacing a
checkpoint at its path (``replace``), the checksumming DCP writer with its reused plans,
record layouts and ``.metadata`` pickles (``dcp_writer``, ``planning``, ``records``,
``dcp_metadata``), and the skeleton's ``torch.save`` bytes (``skeleton_bytes``).
"""
