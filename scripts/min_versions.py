"""Print the pins of the minimum-versions job: every ``>=`` floor of pyproject.toml as ``==``.

The floors of the package's dependencies and of the ``gcs``/``s3`` extras are pinned;
the test tools are left to pip (they only have to install next to the floors).
Used by ``scripts/test_min_versions.sh``; raising a floor in pyproject.toml moves the job.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PINNED_EXTRAS = ("gcs", "s3")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in PINNED_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    pins = []
    for req in reqs:
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)", req)
        if m is None:
            sys.exit(f"min_versions.py: no '>=' floor in {req!r}\nHINT: give every dependency a floor in pyproject.toml.")
        pins.append(f"{m.group(1)}{m.group(2) or ''}=={m.group(3)}")
    return pins


if __name__ == "__main__":
    print(" ".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml")))
