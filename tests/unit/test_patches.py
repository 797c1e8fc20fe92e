"""Every patch of Lightning, torch or DeepSpeed is in one list (lightning/_compat/__init__.py
``PATCHES``): a module that makes one the list does not name fails here, and so does an entry
whose module no longer makes one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_preempt.lightning import _compat

PACKAGE = Path(_compat.__file__).parents[2]

#: What making a patch looks like in this code base: binding or setting attributes on objects
#: we do not own, replacing module functions, global hooks and filters.
PATTERNS = [
    r"\bMethodType\(",
    r"\bsetattr\(",
    r"\.__get__\(",
    r"^\s*(torch|dist|lightning|pl)\.[\w.]+\s*=[^=]",
    r"(?<![\w.])(strategy|trainer|connector|thread|ckpt|loader|batch_sampler|sampler|combined|fit_loop|metric)"
    r"(\.\w+)+\s*=[^=]",
    r"\bcallbacks\.insert\(",
    r"\bregister_optimizer_step_pre_hook\(",
    r"\bwarnings\.filterwarnings\(",
    r"\.addFilter\(",
    r"\b_compat\.rebind\(",
    r"\bwrap_once\(",
]


def _patching_modules() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(p, code) for p in PATTERNS):
                found.setdefault(rel, []).append(f"{number}: {line.strip()}")
    return found


def _listed() -> set[str]:
    return {where.strip() for patch in _compat.PATCHES.values() for where in patch.where.split(",")}


def test_every_module_that_patches_is_in_the_list() -> None:
    found = _patching_modules()
    assert "lightning/strategies.py" in found and "resume/ddp_buckets.py" in found  # the scan sees patches
    unlisted = {rel: lines for rel, lines in found.items() if rel not in _listed() | {"lightning/_compat/__init__.py"}}
    assert not unlisted, (
        f"patches outside lightning/_compat/__init__.py PATCHES: {unlisted}\n"
        "HINT: add an entry (what, where, why, versions checked), or make the change through _compat.rebind."
    )


def test_every_entry_names_a_module_that_patches_and_says_why() -> None:
    found = _patching_modules()
    for key, patch in _compat.PATCHES.items():
        assert patch.what and patch.why and ("Lightning" in patch.checked or "torch" in patch.checked), key
        for where in patch.where.split(","):
            assert where.strip() in found, f"PATCHES[{key!r}] names {where.strip()}, which makes no patch"


def test_rebind_binds_on_the_instance_only_and_refuses_an_unlisted_patch() -> None:
    class Strategy:
        def save(self) -> str:
            return "lightning's"

    ours, other = Strategy(), Strategy()
    _compat.rebind(ours, "every_rank_saves", save=lambda self: f"ours on {self is ours}")
    assert (ours.save(), other.save()) == ("ours on True", "lightning's")
    with pytest.raises(KeyError, match="no patch 'elsewhere'"):
        _compat.rebind(other, "elsewhere", save=lambda self: "")
    assert other.save() == "lightning's"
