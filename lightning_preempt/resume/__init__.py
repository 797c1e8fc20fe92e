"""Resuming: which checkpoint every rank resumes from, and the framework-neutral pieces of
exact resume (RNG, samplers, metric states).
"""
