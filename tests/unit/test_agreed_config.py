"""Which options the ranks must share and how a difference is worded (engine/agreed_config.py);
the real 2-rank refusal is tests/e2e/test_ranks_agree.py."""

from __future__ import annotations

from pathlib import Path

from lightning_preempt.engine.agreed_config import MUST_MATCH, differences, options
from lightning_preempt.engine.config import PreemptionConfig


def _options(tmp: Path, **kw: object) -> dict[str, object]:
    config = PreemptionConfig(dirpath=str(tmp / "ck"), **kw)  # type: ignore[arg-type]
    return options(config, two_tier=False, sharded_keys=("state_dict", "optimizer_states"), verify_on_load=True)


def test_every_compared_option_has_a_value(tmp_path: Path) -> None:
    assert set(_options(tmp_path)) == set(MUST_MATCH)


def test_only_the_options_that_differ_are_named_with_each_value_and_its_ranks(tmp_path: Path) -> None:
    same = _options(tmp_path)
    other = {**same, "dirpath": "/elsewhere", "two_tier": True}
    assert differences([same, same, same]) == []
    lines = differences([same, other, same, other])
    assert lines == [
        f'  dirpath: "{tmp_path / "ck"}" on ranks 0, 2; "/elsewhere" on ranks 1, 3',
        "  two_tier: false on ranks 0, 2; true on ranks 1, 3",
    ]


def test_node_local_places_and_credentials_may_differ(tmp_path: Path) -> None:
    a = _options(tmp_path, local_dirpath="/nvme/a", storage_options={"token": "a"}, exit_code=143)
    b = _options(tmp_path, local_dirpath="/nvme/b", storage_options={"token": "b"}, exit_code=99)
    assert differences([a, b]) == []
    assert "token" not in str(a)  # credentials never travel to the other ranks
