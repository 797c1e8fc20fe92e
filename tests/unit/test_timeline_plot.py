"""``report --plot`` reads at a glance (issue 56): every process is labelled, even one too short
for a label inside its bar; each restart's bar carries the report's one "down" figure; the
headline leads with steps lost and what checkpointing cost, goodput last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_preempt.cli.timeline import plot_timeline

pytest.importorskip("matplotlib")


def _report() -> dict[str, Any]:
    # three processes; the second trains for only 0.2 s of a 30 s run (too narrow for a label inside)
    segments = [
        {"started_t": 0.0, "first_step_t": 4.0, "end_t": 10.0},
        {"started_t": 12.0, "first_step_t": 15.0, "end_t": 15.2},
        {"started_t": 17.0, "first_step_t": 20.5, "end_t": 30.0},
    ]
    steps = (
        [(4.0 + i * 0.5, i, 0) for i in range(12)] + [(15.1, 12, 1)] + [(20.5 + i * 0.5, 12 + i, 2) for i in range(19)]
    )
    preemption = {"steps_lost": 0, "resumed_step": 12, "restart": 1, "kind": "signal", "received_t": 10.0,
                  "exit_t": 10.0, "steps_lost_at_least": False, "source": "SIGTERM", "step": 11}  # fmt: skip
    return {
        "first_t": 0.0, "wall_s": 30.0, "end_t": 30.0, "segments": segments, "goodput": 0.5, "steps_lost": 0,
        "down_s": 10.5, "checkpoint_overhead": 0.004, "preemptions": [preemption, {**preemption, "restart": 2}],
        "timeline": {"saves": [(6.0, 4, "periodic", 0.002, 0.05), (10.0, 11, "emergency", 0.002, 0.05)], "steps": steps},
    }  # fmt: skip


def test_every_process_and_every_down_is_labelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    texts: list[str] = []
    real_savefig = matplotlib.figure.Figure.savefig

    def capture(fig: Any, *args: Any, **kwargs: Any) -> None:
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        texts.append(fig._suptitle.get_text())
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    plot_timeline(_report(), str(tmp_path / "t.png"))
    assert {"#1", "#2", "#3"} <= set(texts)  # #2 is 0.7 % of the span: labelled under its bar
    assert "5s" in texts and "5.3s" in texts, texts  # each down: exit to the next first step (10->15, 15.2->20.5)
    head = texts[-1]
    assert head.index("steps lost") < head.index("checkpointing 0.4% of training") < head.index("goodput 50%")
    assert (tmp_path / "t.png").stat().st_size > 10_000
