"""What a run's ledger says it cost: restarts, time training and down, steps lost, goodput
(each figure: docs/goodput.md, "The report"). Pure computation over checked records, no I/O,
no torch; seconds, wall clock. A *segment* is one process (one restart), from its start to its
preemption or finish record (killed without warning: its last record).

The wall time is three parts that add up: the first start (the first process's start to its
first step, which a run never preempted pays too), training, and *down*: from each process's
end to the next one's first step (teardown, the queue, the start-up and the resume), the one
"down" figure of the report, its table, the timeline and the demo. Goodput is the training
that was kept (less the blocking in saves and the steps redone) over the wall time after the
first start: what preemption and checkpointing could have cost.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Any


@dataclasses.dataclass
class Segment:
    """One process of the run."""

    restart: int
    started_t: float  # the process's start (or its first record's time when unknown)
    first_step_t: float
    resumed_step: int
    end_t: float
    last_step: int
    #: "preempted", "finished", "error", "lost" (a failure record: the heartbeats caught it),
    #: "killed" (no record: SIGKILL, crash) or "running"
    end: str
    records: list[dict[str, Any]]

    @property
    def training_s(self) -> float:
        return max(0.0, self.end_t - self.first_step_t)

    @property
    def steps(self) -> int:
        return max(0, self.last_step - self.resumed_step)


def segments(records: list[dict[str, Any]], *, running: bool = False) -> list[Segment]:
    """The run's segments, in order (``running``: the last one has not ended yet)."""
    by_restart: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_restart.setdefault(record["restart"], []).append(record)
    out: list[Segment] = []
    for restart in sorted(by_restart):
        recs = sorted(by_restart[restart], key=lambda r: r["seq"])
        start = next((r for r in recs if r["kind"] == "start"), None)
        if start is None:
            continue  # its start record was lost: nothing to place it by
        steps = [r["step"] for r in recs if "step" in r] + [start["resumed_step"]]
        ending = next((r for r in reversed(recs) if r["kind"] in ("failure", "preemption", "finish", "error")), None)
        end = {"preemption": "preempted", "finish": "finished", "error": "error", "failure": "lost"}.get(
            ending["kind"] if ending else "", "running" if running and restart == max(by_restart) else "killed"
        )
        first_step_t = start["t"]
        began = start["process_start_t"] if start["process_start_t"] is not None else first_step_t
        out.append(Segment(restart, min(began, first_step_t), first_step_t, start["resumed_step"],
                           max(r["t"] for r in recs), max(steps), end, recs))  # fmt: skip
    for before, seg in itertools.pairwise(out):
        if seg.started_t < before.end_t:  # a second fit in one process: it started when the first ended
            seg.started_t = min(before.end_t, seg.first_step_t)
    return out


def summarize(records: list[dict[str, Any]], folded_saves: dict[int, dict[str, float]] | None = None, *,
              running: bool = False) -> dict[str, Any]:  # fmt: skip
    """The figures of a run (see the module docstring); JSON-ready."""
    segs = segments(records, running=running)
    folded = list((folded_saves or {}).values())
    saves = [r for s in segs for r in s.records if r["kind"] == "save"]
    blocking = sum(r["blocking_s"] for r in saves) + sum(f["blocking_s"] for f in folded)
    n_saves = len(saves) + int(sum(f["count"] for f in folded))
    training = sum(s.training_s for s in segs)
    trained = sum(s.steps for s in segs)
    step_s = training / trained if trained else None
    preemptions = []
    for seg, after in zip(segs, [*segs[1:], None]):
        if seg.end in ("running", "finished"):
            continue
        record = next((r for r in seg.records if r["kind"] == "preemption"), None)
        failure = next((r for r in seg.records if r["kind"] == "failure"), None)
        if record is None and failure is None and seg.end == "error":
            continue  # an agreed error, not a preemption
        resumed = after.resumed_step if after is not None else None
        lost = max(0, seg.last_step - resumed) if resumed is not None else (record or {}).get("steps_lost")
        if failure is not None and record is None:
            kind, source = "node lost", f"rank(s) {failure['lost']} silent {failure['silent_s']:.1f}s (heartbeats)"
        elif record is not None:
            kind, source = ("signal" if record["source"].startswith("SIG") else "notice"), record["source"]
        else:
            kind, source = "killed", "no record (SIGKILL or crash)"
        preemptions.append({
            "restart": seg.restart,
            "kind": kind,
            "source": source,
            "step": record["step"] if record is not None else seg.last_step,
            "committed": record["committed"] if record is not None else None,
            "resumed_step": resumed,
            "steps_lost": lost,
            # killed: steps trained after the last record (progress, every few seconds) are unseen;
            # a failure record carries the survivors' last step
            "steps_lost_at_least": record is None and failure is None,
            # a failure: loss to verdict (the lost ranks' silence when the survivors decided)
            "to_exit_s": record["to_exit_s"] if record is not None else failure["silent_s"] if failure else None,
            "received_t": record["received_t"] if record is not None else None,
            # from the first signal (any rank) to the step every rank agreed on (newer records only)
            "agreed_after_steps": (record or {}).get("agreed_after_steps"),
            "agreed_after_s": (record or {}).get("agreed_after_s"),
            "exit_t": seg.end_t,
            "down_s": _down(seg, after) if after is not None else None,
            "agreed_step": failure["agreed_step"] if failure is not None else None,
            "resumed_tier": _start(after).get("resumed_tier") if after is not None else None,
        })  # fmt: skip
    steps_lost = sum(int(p["steps_lost"] or 0) for p in preemptions)
    lost_s = steps_lost * step_s if step_s is not None else 0.0
    wall = max(0.0, segs[-1].end_t - segs[0].started_t) if segs else 0.0
    useful = max(0.0, training - blocking - lost_s)
    first_start = segs[0].first_step_t - segs[0].started_t if segs else 0.0
    avoidable = wall - first_start  # = training + down
    start_records = [next(r for r in s.records if r["kind"] == "start") for s in segs]
    return {
        "run": records[0]["run"] if records else None,
        "restarts": max(0, len(segs) - 1),
        "processes": len(segs),
        "finished": bool(segs) and segs[-1].end == "finished",
        "first_t": segs[0].started_t if segs else None,
        "end_t": segs[-1].end_t if segs else None,
        "wall_s": wall,
        "training_s": training,
        # every restart's (an agreed error's too), so wall = first start + training + down
        "down_s": sum(_down(before, after) for before, after in itertools.pairwise(segs)),
        "first_start_s": first_start,
        "startup_s": sum(s.first_step_t - s.started_t for s in segs),  # the first start and the restarts'

        "steps_trained": trained,
        "last_step": segs[-1].last_step if segs else 0,
        "step_time_s": step_s,
        "saves": n_saves,
        "checkpoint_blocking_s": blocking,
        "checkpoint_overhead": blocking / training if training > 0 else None,
        "preemptions": preemptions,
        "steps_lost": steps_lost,
        "lost_s": lost_s,
        "useful_s": useful,
        "goodput": useful / avoidable if avoidable > 0 else None,
        "world_size": max((r["world_size"] for r in start_records), default=1),
        "every_n_train_steps": start_records[-1]["every_n_train_steps"] if start_records else None,
        "every_n_seconds": start_records[-1]["every_n_seconds"] if start_records else None,
        "grace_period_s": start_records[-1]["grace_period_s"] if start_records else None,
        "save_cost": save_cost(saves),
        "drains": _drains(records),
        "tier0": _tier0(saves),
        "segments": [_segment_dict(s) for s in segs],
    }


def _down(before: Segment, after: Segment) -> float:
    """From ``before``'s end (its last record) to ``after``'s first step: teardown, queue, start-up, resume."""
    return max(0.0, after.first_step_t - before.end_t)


def _start(seg: Segment) -> dict[str, Any]:
    return next((r for r in seg.records if r["kind"] == "start"), {})


def _drains(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Two tiers: the uploads of local checkpoints to ``dirpath`` (``drain`` records)."""
    drains = [r for r in records if r["kind"] == "drain"]
    done = [r for r in drains if r["drained_s"] is not None]
    return {
        "count": len(drains), "uploaded": len(done), "bytes": sum(r["bytes"] for r in done),
        "drained_s": sum(r["drained_s"] for r in done), "skipped": sum(r["skipped"] is not None for r in drains),
        "failed": sum(r["error"] is not None for r in drains), "newest_step": max((r["step"] for r in done), default=None),
    }  # fmt: skip


def _tier0(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Tier 0 (docs/tier0.md): its copies to host memory (``save`` records of tier ``memory``)."""
    copies = [r for r in saves if r["tier"] == "memory"]
    done = [r for r in copies if r["committed_s"] is not None]
    return {
        "count": len(copies), "committed": len(done), "failed": len(copies) - len(done),
        "blocking_s": sum(r["blocking_s"] for r in copies), "newest_step": max((r["step"] for r in done), default=None),
        "committed_s": statistics.median(r["committed_s"] for r in done) if done else None,
    }  # fmt: skip


def _segment_dict(s: Segment) -> dict[str, Any]:
    return {"restart": s.restart, "started_t": s.started_t, "first_step_t": s.first_step_t, "end_t": s.end_t,
            "end": s.end, "resumed_step": s.resumed_step, "last_step": s.last_step}  # fmt: skip


def save_cost(saves: list[dict[str, Any]]) -> dict[str, float] | None:
    """Medians of the periodic saves that committed: blocking seconds, seconds to commit,
    bytes, and the write bandwidth behind the blocking copy (what ``plan`` takes)."""
    done = [r for r in saves if r["committed_s"] is not None and r["tier"] != "memory"]  # tier 0 has its own
    periodic = [r for r in done if r["save_kind"] == "periodic"] or done
    if not periodic:
        return None
    flush = [r["bytes"] / (r["committed_s"] - r["blocking_s"]) for r in periodic if r["committed_s"] > r["blocking_s"]]
    return {
        "blocking_s": statistics.median(r["blocking_s"] for r in periodic),
        "committed_s": statistics.median(r["committed_s"] for r in periodic),
        "bytes": statistics.median(r["bytes"] for r in periodic),
        "write_bandwidth": statistics.median(flush) if flush else 0.0,
    }
