"""Saving: staging into host buffers, the job queue, the DCP writer, the commit protocol,
replacing a checkpoint at its path, two tiers and the drain, the peer replica, the lease.
"""
