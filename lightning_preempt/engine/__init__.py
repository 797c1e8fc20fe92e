"""The framework-neutral engine a training loop drives, and its validated configuration.
"""
