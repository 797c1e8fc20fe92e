"""The package's shape (issue 34): one name for one module, folders a reader can take in at once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_preempt"
SPECIAL = {"__init__.py", "__main__.py"}
MAX_MODULES = 12


def test_no_two_modules_share_a_file_name() -> None:
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in SPECIAL)
    shared = {name: sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob(name)) for name, n in names.items() if n > 1}
    assert not shared, f"name each module for its role: {shared}"


def test_no_folder_holds_more_than_twelve_modules() -> None:
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    crowded = {}
    for folder in folders:
        count = sum(1 for p in folder.glob("*.py") if p.name not in SPECIAL)
        if count > MAX_MODULES:
            crowded[str(folder.relative_to(PACKAGE.parent))] = count
    assert not crowded, f"split these by job: {crowded}"
    assert len(folders) > 10  # the walk found the package's folders
