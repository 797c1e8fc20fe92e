"""``lightning-preempt``: the operator command (``ls``, ``verify``, ``export``, ``plan``).

``ls``, ``verify`` and ``plan`` import neither torch nor Lightning (the manifest, sizes,
CRC32C and a replay of the loader's allow-lists need neither; an import-linter contract in
pyproject.toml keeps it so); ``export`` imports torch when it runs.

* ``app``: the parser and the dispatch, exit codes (``main``).
* ``cmd_ls``, ``cmd_verify``, ``cmd_export``, ``cmd_plan``: one module per command (its
  options and what it prints).
* ``options``: what all commands share on the command line (``-o``, usage errors).
* ``resolve``: which checkpoint a URL names; storage failures as errors with a HINT.
* ``output``: tables, errors, the progress bar.
* ``plan``: Young/Daly math (pure); ``export``: writing one plain ``.ckpt`` (torch).
"""

from lightning_preempt.cli.app import main

__all__ = ["main"]
