"""Compare two pytest JUnit XML reports test by test: ``python compare.py base.xml other.xml``."""

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag == "failure":
                state = "failed"
            elif child.tag == "error":
                state = "error" if state == "passed" else f"{state}+error"
            elif child.tag == "skipped":
                state = "skipped"
        if name in out and out[name] != state:  # a call failure and a teardown error
            state = f"{out[name]}+{state}"
        out[name] = state
    return out


def main() -> None:
    base, other = outcomes(sys.argv[1]), outcomes(sys.argv[2])
    print("base ", dict(Counter(base.values())))
    print("other", dict(Counter(other.values())))
    for name, state in base.items():
        if other.get(name) != state:
            print(f"{state:8s} -> {other.get(name)!s:14s} {name}")


if __name__ == "__main__":
    main()
