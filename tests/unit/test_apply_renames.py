"""scripts/apply_renames.py rewrites moved module paths (issue 34's map) in every spelling."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _renamer() -> object:
    spec = importlib.util.spec_from_file_location("apply_renames", ROOT / "scripts" / "apply_renames.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["apply_renames"] = module
    spec.loader.exec_module(module)
    return module.Renamer(module.read_map(str(ROOT / "scripts" / "renames_issue34.txt")))


def test_every_spelling_is_rewritten_and_only_whole_paths() -> None:
    renamer = _renamer()
    text = (
        "from lightning_preempt.save.staging import HostStager\n"
        "from lightning_preempt.save import staging, saver as s, overlap\n"
        "    from lightning_preempt.engine import ledger as writer  # note\n"
        'patch("lightning_preempt.save.tiers.TwoTier.wait")\n'
        "see save/layout.py and lightning_preempt/format/ledger.py\n"
        "lightning_preempt.save.stagingx stays; tests/save/tiers.py stays\n"
    )
    assert renamer.rewrite(text) == (  # type: ignore[attr-defined]
        "from lightning_preempt.staging.stager import HostStager\n"
        "from lightning_preempt.staging import stager as staging, overlap\n"
        "from lightning_preempt.save import saver as s\n"
        "    from lightning_preempt.engine import ledger_writer as writer  # note\n"
        'patch("lightning_preempt.tiers.two_tier.TwoTier.wait")\n'
        "see write/replace.py and lightning_preempt/format/ledger_records.py\n"
        "lightning_preempt.save.stagingx stays; tests/save/tiers.py stays\n"
    )


def test_the_map_names_modules_that_exist() -> None:
    for line in (ROOT / "scripts" / "renames_issue34.txt").read_text().splitlines():
        old, new = line.split()
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new
