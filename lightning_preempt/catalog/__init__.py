"""Finding checkpoints under a root: listing, the newest valid one, retention, what is
ours to delete, and which checkpoints are known to verify.
"""
