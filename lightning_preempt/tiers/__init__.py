"""Moving committed checkpoints between stores: two tiers (commit to node-local storage,
drain to a bucket: ``two_tier``, ``drain``) and the peer replica on another node (``peer``).
"""
