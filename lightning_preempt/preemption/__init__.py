"""Preemption: sources (signals, cloud notices), when ranks agree, the deadline, the
controller and its emergency sequence, requeue, the quick exit and the signals after
training. Framework-neutral.
"""
