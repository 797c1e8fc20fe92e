"""The package's shape (issue 34): one name for one module, folders a reader can take in at once."""

from __future__ import annotations

import ast
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


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at any depth (functions and TYPE_CHECKING too)."""
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*here[: len(here) - node.level + 1], node.module or ""]).strip(".") if node.level else node.module
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(subs if len(subs) == len(node.names) else {*subs, str(base)})
    return (found & modules) - {name}


def test_no_two_modules_import_each_other_even_through_others() -> None:
    paths = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}  # fmt: skip
    graph = {name: _imports(path, set(paths)) for name, path in paths.items()}
    assert graph["lightning_preempt.staging.budget"] >= {"lightning_preempt.staging.stager"}  # the walk sees imports

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*trail, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
        return None

    circles = [c for c in map(cycle_from, sorted(graph)) if c is not None]
    assert not circles, f"import circles (one module must stop importing the other): {circles[:3]}"
