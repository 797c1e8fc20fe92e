"""Issue 32: every extra of pyproject.toml has a row in README's extras table ([plot] had none)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_extra_is_in_readmes_table() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in extras if f"| `[{name}]` |" not in readme]
    assert "plot" in extras
    assert not missing, f"README's extras table lacks {missing}"
