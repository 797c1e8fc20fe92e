"""Resuming: which checkpoint every rank resumes from (``resolver``), and the
framework-neutral pieces of exact resume that a front-end's driver composes: the saved
format (``exact_state``), per-loader bookkeeping (``loaders``), samplers, RNG and metric
states (docs/exact-resume.md).
"""
