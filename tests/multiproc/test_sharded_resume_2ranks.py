"""ModelParallelStrategy (FSDP2) resumed at the same world size: the sharded load's shared
verification is collective, and rank 0 (which verified while choosing) must still join it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sharded import _assert_resumed_state_matches, _run

pytestmark = pytest.mark.multiproc


@pytest.mark.slow
def test_model_parallel_resumes_at_2_ranks(tmp_path: Path) -> None:
    _run(tmp_path, 2, "model_parallel", max_steps=10)
    _run(tmp_path, 2, "model_parallel", max_steps=12, dump=str(tmp_path / "start12"))
    _assert_resumed_state_matches(tmp_path / "start12", tmp_path / "ck" / "step-0000000010", ranks=2)
