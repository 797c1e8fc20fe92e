"""Regenerate the option tables of docs/options.md from lightning_preempt/engine/config.py (each
field's docstring is its row) and engine/deprecated.py (the old spellings):

    python scripts/gen_options.py          # rewrite docs/options.md
    python scripts/gen_options.py --check  # exit 1 when it is stale (tests/unit/test_options_doc.py)

Only the text between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` is replaced."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

from lightning_preempt.engine import config, deprecated

DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n).*?(<!-- end generated -->)", re.S)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls``, one line each."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs, last = {}, None
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            last = node.target.id
        elif last and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[last], last = " ".join(str(node.value.value).split()), None
        else:
            last = None
    return docs


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "(required)"


def table(cls: type) -> str:
    docs, fields = field_docs(cls), {f.name: f for f in dataclasses.fields(cls)}
    rows = [f"| `{name}` | {_default(fields[name])} | {docs[name]} |" for name in config.own_fields(cls)]
    return "\n".join(["| option | default | what it does |", "|---|---|---|", *rows]) + "\n"


def renames() -> str:
    rows = [f"| `{old}` (callback, `Preemption`) | `tuning=Tuning({new}=...)` |" for old, new in
            deprecated.FRONT_TO_TUNING.items()]  # fmt: skip
    rows.append("| `sources` (callback, `Preemption`) | `notices=[...]` (names and sources together) |")
    rows += [f"| `{old}` (plugin) | `tuning=Tuning({new}=...)` |" for old, new in deprecated.PLUGIN_TO_TUNING.items()]
    rows.append("| `local_dirpath` (plugin) | `PreemptionCallback(local_dirpath=...)` (it hands it to the plugin) |")
    rows += [f"| `{old}` | none: {why} |" for old, why in deprecated.FIXED.items()]
    return "\n".join(["| 0.2 spelling | now |", "|---|---|", *rows]) + "\n"


TABLES = {"PreemptionConfig": lambda: table(config.PreemptionConfig), "Tuning": lambda: table(config.Tuning),
          "CheckpointIOConfig": lambda: table(config.CheckpointIOConfig), "deprecated": renames}  # fmt: skip


def render(text: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + m.group(3), text)


if __name__ == "__main__":
    current = DOC.read_text()
    fresh = render(current)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if fresh == current else "docs/options.md is stale: run python scripts/gen_options.py")
    DOC.write_text(fresh)
