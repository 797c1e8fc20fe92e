"""Rewrite module paths in files after modules were moved (issue 34's reorganisation).

Usage::

    python scripts/apply_renames.py MAP FILE...      # rewrite FILEs in place
    python scripts/apply_renames.py --check MAP FILE...   # list what would change, exit 1 if any

MAP (issue 34's: scripts/renames_issue34.txt) has one module a line: ``old.dotted.path
new.dotted.path`` (``#`` starts a comment).
Three spellings of a module are rewritten, each only as a whole path (``a.b`` never
matches inside ``a.bc`` or ``x.a.b``):

* dotted: ``lightning_preempt.save.staging`` and anything after it
  (``lightning_preempt.save.staging.HostStager``, mock targets, ``:mod:`` roles);
* ``from PARENT import name [as alias], ...`` where ``PARENT.name`` moved: the line is split
  by new parent, and a module whose own name changed is imported ``as`` its old name, so the
  code below keeps working unchanged;
* file paths in prose and docs: ``lightning_preempt/save/staging.py`` and the short form
  ``save/staging.py`` (the package's own docstrings name modules that way).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = "lightning_preempt"


def read_map(path: str) -> dict[str, str]:
    """``{old dotted path: new dotted path}`` from a map file."""
    renames: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SystemExit(f"{path}:{number}: expected 'old new', got {line!r}")
        renames[parts[0]] = parts[1]
    return renames


def _alternation(keys: list[str]) -> str:
    return "|".join(re.escape(key) for key in sorted(keys, key=len, reverse=True))


class Renamer:
    """The three rewrites of one map, compiled once."""

    def __init__(self, renames: dict[str, str]) -> None:
        self.renames = renames
        self.dotted = re.compile(rf"(?<![\w.])({_alternation(list(renames))})(?![\w])")
        self.paths = {self._file(old): self._file(new) for old, new in renames.items()}
        short = {}
        for old, new in renames.items():
            if old.startswith(ROOT + ".") and new.startswith(ROOT + "."):
                short[self._file(old)[len(ROOT) + 1:]] = self._file(new)[len(ROOT) + 1:]
        self.short = short
        self.file_re = re.compile(rf"(?<![\w./])((?:{re.escape(ROOT)}/)?)({_alternation(list(short))})(?![\w])")
        parents = {old.rpartition(".")[0] for old in renames}
        self.from_re = re.compile(
            rf"^(?P<indent>[ \t]*)from (?P<parent>{_alternation(sorted(parents))}) import "
            r"(?P<names>\([^)]*\)|[^\n#]*?)(?P<tail>[ \t]*(#[^\n]*)?)$",
            re.MULTILINE,
        )

    @staticmethod
    def _file(dotted: str) -> str:
        return dotted.replace(".", "/") + ".py"

    def _from_import(self, match: re.Match[str]) -> str:
        parent, indent = match["parent"], match["indent"]
        names = [n.strip() for n in match["names"].strip("()").replace("\n", " ").split(",") if n.strip()]
        groups: dict[str, list[str]] = {}
        moved = False
        for item in names:
            name, _, alias = (part.strip() for part in item.partition(" as "))
            new = self.renames.get(f"{parent}.{name}")
            if new is None:
                groups.setdefault(parent, []).append(item)
                continue
            moved = True
            new_parent, _, new_name = new.rpartition(".")
            bound = alias or name
            groups.setdefault(new_parent, []).append(new_name if new_name == bound else f"{new_name} as {bound}")
        if not moved:
            return match[0]
        lines = [f"{indent}from {p} import {', '.join(items)}" for p, items in groups.items()]
        lines[0] += match["tail"]
        return "\n".join(lines)

    def rewrite(self, text: str) -> str:
        text = self.from_re.sub(self._from_import, text)
        text = self.dotted.sub(lambda m: self.renames[m[1]], text)
        return self.file_re.sub(lambda m: m[1] + self.short[m[2]], text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only list files that would change")
    parser.add_argument("map")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    renamer = Renamer(read_map(args.map))
    changed = 0
    for name in args.files:
        path = Path(name)
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        new = renamer.rewrite(text)
        if new != text:
            changed += 1
            print(name)
            if not args.check:
                path.write_text(new)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
