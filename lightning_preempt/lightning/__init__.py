"""The Lightning front-end: the Trainer callback, the CheckpointIO plugin, strategy hooks,
exact resume of the Trainer's loops, reporting to its loggers, the peer-replica callback.
"""
