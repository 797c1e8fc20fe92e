"""Staging: copying a rank's share of the state into host memory, within a budget. No I/O.

The host buffers and their reuse (``stager``), the host-memory budget that decides which
tensors get buffers and which are streamed (``budget``), and overlapped staging, where a
save returns before its large copies finish (``overlap``).
"""
