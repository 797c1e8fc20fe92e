"""Saving: the save pipeline of one process (``saver``: stage, queue, write, commit, drain),
what each save measured (``history``), the lease (one writer per dirpath) and the storage
probe (``preflight``). The pieces it composes live below it: ``staging/``, ``write/``, ``tiers/``.
"""
