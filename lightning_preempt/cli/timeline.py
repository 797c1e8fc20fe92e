"""``report --plot``: a run's timeline as a PNG (matplotlib, the ``[plot]`` extra): one band
per process (startup, training, down), saves and preemptions; below, the step over time
with the steps a preemption lost shaded.
"""

from __future__ import annotations

from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import UsageError
from lightning_preempt.cli.plan import format_duration

_TRAIN, _START, _DOWN, _SAVE, _SIGNAL, _KILL = "#2ca02c", "#b0b0b0", "#d62728", "#1f77b4", "#d62728", "#000000"
#: Preemption kinds without a signal: a SIGKILL that left no record, a node loss the heartbeats caught.
_UNANNOUNCED = ("killed", "node lost")


def _unit(span_s: float) -> tuple[float, str]:
    for size, name in ((86400.0, "days"), (3600.0, "hours"), (60.0, "minutes")):
        if span_s >= 2 * size:
            return size, name
    return 1.0, "seconds"


def plot_timeline(report: dict[str, Any], path: str, *, title: str = "") -> None:
    """Draw ``report`` (cli/commands/cmd_report.py's, from a ledger) into the PNG file ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UsageError("--plot needs matplotlib", hint="pip install 'lightning_preempt[plot]'") from None
    t0 = report["first_t"]
    scale, unit = _unit(max(report["wall_s"], 1e-6))

    def x(t: float) -> float:
        return (t - t0) / scale

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.2), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [1, 2.6]})  # fmt: skip
    segs = report["segments"]
    span = x(report["end_t"])
    if segs:  # only the first start is drawn as start-up: every later one is inside a restart's "down"
        first = segs[0]
        top.barh(
            0, x(first["first_step_t"]) - x(first["started_t"]), left=x(first["started_t"]), color=_START, height=0.6
        )
    for i, seg in enumerate(segs):
        width = x(seg["end_t"]) - x(seg["first_step_t"])
        top.barh(0, width, left=x(seg["first_step_t"]), color=_TRAIN, height=0.6)
        middle = x(seg["first_step_t"]) + width / 2
        inside = width > span * 0.04  # every process is labelled: inside its bar, or under a narrow one
        top.text(middle, 0 if inside else -0.42, f"#{i + 1}", ha="center", va="center", fontsize=8,
                 color="white" if inside else _TRAIN, fontweight="bold")  # fmt: skip
        if i + 1 < len(segs):
            # the report's one "down": this process's end to the next one's first step (its start-up included)
            back = segs[i + 1]["first_step_t"]
            top.barh(0, x(back) - x(seg["end_t"]), left=x(seg["end_t"]), color=_DOWN, alpha=0.8, height=0.6)
            top.text((x(back) + x(seg["end_t"])) / 2, -0.42, format_duration(back - seg["end_t"]),
                     ha="center", va="center", fontsize=8, color=_DOWN)  # fmt: skip
    saves = report["timeline"]["saves"]
    for t, _step, kind, _blocking, committed in saves:
        began = t - (committed or 0.0)
        top.plot([x(began)] * 2, [0.32, 0.5], color=_SAVE if kind != "emergency" else "#9467bd", lw=1.4)
    top.set(yticks=[], ylim=(-0.6, 1.15))
    top.legend(handles=[Patch(color=_START, label="first start (to the first step)"),
                        Patch(color=_TRAIN, label="training (process #)"),
                        Patch(color=_DOWN, alpha=0.8, label="down (exit to the next first step)"),
                        Patch(color=_SAVE, label="save"), Patch(color="#9467bd", label="snapshot")],
               loc="upper left", ncol=5, fontsize=8, frameon=False)  # fmt: skip
    by_restart: dict[int, list[tuple[float, int]]] = {}
    for t, step, restart in report["timeline"]["steps"]:
        by_restart.setdefault(restart, []).append((x(t), step))
    for k, points in enumerate(by_restart.values()):
        points.sort()
        bottom.plot([p[0] for p in points], [p[1] for p in points], color=_TRAIN, lw=2,
                    label="global step (one line per process)" if k == 0 else None)  # fmt: skip
    for p in report["preemptions"]:  # the steps trained and then trained again, in the colour of their loss
        if p["steps_lost"] and p["resumed_step"] is not None:
            redo = sorted(pt for pt in by_restart.get(p["restart"], []) if pt[1] >= p["resumed_step"])
            bottom.plot([q[0] for q in redo], [q[1] for q in redo], color=_KILL if p["kind"] in _UNANNOUNCED else _SIGNAL,
                        lw=3.5, label="steps lost (trained again after the restart)")  # fmt: skip
    committed = [(x(t - (c or 0.0)), s) for t, s, _k, _b, c in saves if c is not None]
    if committed:
        bottom.plot(*zip(*committed, strict=True), "o", color=_SAVE, ms=4, label="checkpoint committed", zorder=3)
    for p in report["preemptions"]:
        killed = p["kind"] in _UNANNOUNCED
        color = _KILL if killed else _SIGNAL
        when = x(p["received_t"]) if p["received_t"] is not None else x(p["exit_t"])
        for ax in (top, bottom):
            ax.axvline(when, color=color, lw=1.2, ls="--" if killed else ":")
        lost = p["steps_lost"] or 0
        at_least = ">=" if p["steps_lost_at_least"] and lost else ""
        what = "SIGKILL?" if p["kind"] == "killed" else untrusted_text(p["source"], 20)
        label = f"{what}\nstep {p['step']}\n{at_least}{lost} lost"
        bottom.annotate(label, (when, p["step"]), xytext=(4, 6), textcoords="offset points", fontsize=8, color=color)
    bottom.set(xlabel=f"{unit} since the first start", ylabel="global step", xlim=(0, None), ylim=(0, None))
    bottom.grid(alpha=0.3)
    bottom.legend(loc="lower right", fontsize=8)
    # what a reader asks first: steps lost, what checkpointing cost, time down; goodput last
    goodput, overhead = report["goodput"], report.get("checkpoint_overhead")
    head = "  |  ".join([
        f"{len(report['preemptions'])} preemptions, {report['steps_lost']} steps lost",
        f"checkpointing {overhead:.1%} of training" if overhead is not None else "checkpointing -",
        f"down {format_duration(report['down_s'])}",
        f"goodput {goodput:.0%}" if goodput is not None else "goodput -",
    ])  # fmt: skip
    fig.suptitle(head, fontsize=12, fontweight="bold")
    if title:
        top.set_title(untrusted_text(title, 100), fontsize=9, color="0.3")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
