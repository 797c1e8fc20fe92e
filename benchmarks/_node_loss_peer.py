"""bench_node_loss.py ``--tier0 X --nodes 2``: tier 0 across two hosts, a whole node lost
with its memory (docs/tier0.md, "Several hosts").

Two network-namespace nodes, each agent with its own tier-0 memory (tests/support/netns_job.py
``memory=``), tier 0 on (``"auto"`` or a fixed K) with the peer copy, the disk tier every
``--every`` steps. One chain of launches; each trial waits for a phase (``steps``: 1..2K
steps past the resume, at most 2 disk intervals; ``tier-0 copy``: node 0's newest copy has no manifest yet;
``peer transfer``: node 0's copy committed, node 1's not yet, the ring's transfer; ``disk
flush``: a disk ``step-N`` without its manifest), SIGKILLs every process of a random node
(the pids taken beforehand: no ``ip netns pids`` between the sight and the kill), waits
for the survivor to exit, **wipes the lost node's tier-0 directory** (a replacement node),
and restarts both nodes. The phase recorded is the one seen at the last poll before the
kill, so a kill lands a few ms after it.

Per trial: steps lost (max step seen - the restart's step), the K in force, the expected
resume (the newest checkpoint that verifies independently, fault_injection.py ``scan``, on
the disk and in the survivor's memory: what is left after the loss), the tier the ledger
says the restart resumed from (``lightning_preempt.cli report DIR --json``, as
tests/multihost/test_tier0_replacement.py reads it), and the survivor's exit. At the end the
last launch trains to ``--max-steps``; its weights are compared with an uninterrupted run of
the same job (same world size, tier 0 on): bit-identical expected. ``--n-minus-1``: one such
trial, then the job goes on at world size 1 on the survivor (:func:`main_n_minus_1`).
``--fault partition``: the node's link goes down instead (nobody dies, packets stop): both
sides must exit within 10 s with one failure record between them; the link comes back, both
nodes keep their memory, and the expected resume is the newest checkpoint that verifies on the
disk or across both nodes' memories (``fault_injection.scan_union``: what the restart completes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import table, work_verdict
from fault_injection import RESUME_RE, bound_in_force, failure_records, newest_ok, scan, scan_union
from netns import Hosts
from netns_job import NodeJob

ROOT = Path(__file__).resolve().parent.parent
K_RE = re.compile(r"(?:tier 0 copies|a copy) every (\d+) steps")  # chosen, or carried with the bound
STEP_RE = re.compile(r"^step-(\d+)")
PHASES = ("steps", "tier-0 copy", "peer transfer", "disk flush")


def _newest(root: Path, old: frozenset[Path] = frozenset()) -> Path | None:
    dirs = [(int(m.group(1)), d) for d in root.glob("step-*")
            if d.is_dir() and d not in old and (m := STEP_RE.match(d.name))]  # fmt: skip
    return max(dirs)[1] if dirs else None


def leftovers(memory: Path, disk: Path) -> frozenset[Path]:
    """The uncommitted directories there now: a kill's leftovers are no save in flight."""
    dirs = [*disk.glob("step-*"), *(memory / "node0").glob("step-*")]
    return frozenset(d for d in dirs if d.is_dir() and not (d / "manifest.json").exists())


def phase_now(memory: Path, disk: Path, old: frozenset[Path] = frozenset()) -> str:
    """What is in flight now: a disk flush, else node 0's local copy, else the transfer
    (node 1 gets the manifest last), else nothing ("steps"); ``old``: leftovers to ignore."""
    if any(d.name.startswith("step-") and d not in old and not (d / "manifest.json").exists() for d in disk.iterdir()):
        return "disk flush"
    own = _newest(memory / "node0", old)
    if own is not None and not (own / "manifest.json").exists():
        return "tier-0 copy"
    if own is not None and not (memory / "node1" / own.name / "manifest.json").exists():
        return "peer transfer"
    return "steps"


def k_now(job: NodeJob, fixed: int | None) -> int | None:
    """The K in force: fixed, or the last one rank 0 logged (auto)."""
    if fixed is not None:
        return fixed
    log = job.status / "node0.log"
    found = K_RE.findall(log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1]) if found else None


def bound_now(job: NodeJob) -> int | None:
    """The loss bound in force: the last one rank 0 logged (every rank agrees on it)."""
    log = job.status / "node0.log"
    return bound_in_force(log.read_text(errors="replace")) if log.exists() else None


def resumed(job: NodeJob) -> int | None:
    text = "\n".join((job.status / f"node{n}.log").read_text(errors="replace") for n in job.nodes
                     if (job.status / f"node{n}.log").exists())  # fmt: skip
    found = RESUME_RE.findall(text)
    return int(found[-1][1]) if found else None


def ledger_tier(dirpath: Path, n: int, timeout: float = 120) -> tuple[int | None, str | None]:
    """The ``n``-th preemption's resumed step and tier, from the ledger (the CLI's report)."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run([sys.executable, "-m", "lightning_preempt.cli", "report", str(dirpath), "--json"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
        lost = json.loads(done.stdout).get("preemptions", []) if done.returncode == 0 and done.stdout else []
        if (len(lost) >= n and lost[n - 1]["resumed_step"] is not None) or time.monotonic() > deadline:
            return (lost[n - 1]["resumed_step"], lost[n - 1]["resumed_tier"]) if len(lost) >= n else (None, None)
        time.sleep(1.0)


def one_trial(cfg: argparse.Namespace, hosts: Hosts, job: NodeJob, memory: Path, rng: random.Random) -> dict[str, object]:
    """Wait for a phase, kill a node, wait for the survivor, wipe the lost node's memory."""
    start = max(0, resumed(job) or 0)
    old = leftovers(memory, job.dirpath)
    deadline = time.monotonic() + 240
    while not list((memory / "node1").glob("step-*/manifest.json")):  # a copy on both nodes first
        assert time.monotonic() < deadline, "no tier-0 copy reached node 1\n" + job.log(0)
        time.sleep(0.05)
    want = rng.choice(cfg.phases.split(",") if cfg.phases else PHASES)
    victim = rng.choice([0, 1] if cfg.victim is None else [cfg.victim])
    pids = hosts.pids(victim)
    if want == "steps":
        # up to 2 K past the resume, but at most 2 disk intervals: an auto K of 90 would
        # otherwise spend the steps the later trials need (--max-steps)
        job.wait_step(start + rng.randint(1, min(2 * (k_now(job, cfg.fixed_k) or 5), 2 * cfg.every)))
        time.sleep(rng.uniform(0, cfg.step_sleep))
        seen_phase = phase_now(memory, job.dirpath, old)
    else:
        deadline = time.monotonic() + 120
        while (seen_phase := phase_now(memory, job.dirpath, old)) != want:
            assert time.monotonic() < deadline and job.step(0) < cfg.max_steps - 5, f"no {want} seen\n{job.log(0)}"
            time.sleep(0.002)
    seen, k, bound = max(job.step(r) for r in (0, 1)), k_now(job, cfg.fixed_k), bound_now(job)
    copying = _newest(memory / "node0", old) if seen_phase in ("tier-0 copy", "peer transfer") else None
    # the steps the copy in flight has run (the copy before it is K older): they come on top of K
    # (0 when it started at the step seen: the status file is written after the step's hooks)
    in_flight_steps = max(0, seen - int(STEP_RE.match(copying.name).group(1))) if copying is not None else 0  # type: ignore[union-attr]
    survivor = 1 - victim
    records = failure_records(job.dirpath)  # the earlier trials'
    if cfg.fault == "partition":
        # the victim's link goes down: nobody dies, nothing is reset, packets stop. Both sides
        # must see it and exit with one agreed error; both nodes keep their memory.
        hosts.cut(victim)
        gone = job.wait_gone([0, 1], timeout=60)
        codes = job.wait(60)
        hosts.heal(victim)
        kept = [survivor, victim]
    else:
        for pid in pids:  # at once: the node's processes as they were
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        hosts.kill_node(victim)  # and whatever else is left there
        gone = job.wait_gone([survivor], timeout=60)
        codes = job.wait(60)
        shutil.rmtree(memory / f"node{victim}", ignore_errors=True)  # a replacement node: empty memory
        kept = [survivor]
    # what the restart can resume: the disk, and the copies the nodes left hold together
    disk, mem = scan(job.dirpath), scan_union([memory / f"node{n}" for n in kept])
    ok = newest_ok(disk + mem)
    tier = "none" if ok is None else "memory" if any(c.status == "ok" and c.step == ok.step for c in mem) else "disk"
    return {"want": want, "moment": seen_phase, "victim": victim, "seen": seen, "k": k, "bound": bound,
            "since_resume": seen - start,
            "in_flight_steps": in_flight_steps,
            "exit_s": gone, "survivor_code": codes.get(survivor), "newest": ok.step if ok else 0,
            "failure_records": failure_records(job.dirpath) - records,
            "ok_steps": sorted({c.step for c in disk + mem if c.status == "ok" and c.step is not None}),
            "expected_tier": tier}  # fmt: skip


def job_args(cfg: argparse.Namespace, memory: Path) -> list[str]:
    """The job's arguments; ``memory``: the root ``NodeJob(memory=)`` binds each node's own under."""
    kwargs = {"tier0_every_n_steps": cfg.fixed_k or "auto", "memory_dirpath": str(memory / "tier0")}
    return ["--max-steps", str(cfg.max_steps), "--every", str(cfg.every), "--step-sleep", str(cfg.step_sleep),
            "--width", str(cfg.width), "--ledger-progress-s", "0.5", "--cb-kwargs", json.dumps(kwargs)]  # fmt: skip


def main_peer(cfg: argparse.Namespace, argv: list[str] | None, report: Callable[..., None]) -> int:
    """``--tier0 X --nodes 2`` (module docstring)."""
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="lp-node-loss-peer-"))
    memory = Path("/dev/shm") / work.name
    cfg.fixed_k = None if cfg.tier0 == "auto" else int(cfg.tier0)
    args = job_args(cfg, memory)
    trials: list[dict[str, object]] = []
    try:
        with Hosts(2) as hosts:
            ref = NodeJob(hosts, work / "reference", [0, 1], job_args(cfg, memory / "ref"), memory=memory / "ref")
            assert ref.wait(900) == {0: 0, 1: 0}, ref.log(0)
            reference = (ref.result(0) or {}).get("weights")
            shutil.rmtree(memory / "ref", ignore_errors=True)
            job = NodeJob(hosts, work / "run", [0, 1], args, memory=memory)
            for i in range(cfg.trials):
                trial = one_trial(cfg, hosts, job, memory, rng)
                job = NodeJob(hosts, work / "run", [0, 1], args, memory=memory)  # both nodes, one replaced
                deadline = time.monotonic() + 300
                while (got := resumed(job)) is None and job.step(0) < 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                got = resumed(job) if got is None else got
                got = 0 if got is None and job.step(0) >= 0 else got  # trained from scratch: nothing to resume
                trial["resumed"] = got
                trial["ledger_step"], trial["tier"] = ledger_tier(job.dirpath, i + 1)
                trial["lost"] = max(0, int(trial["seen"]) - got) if got is not None else None  # type: ignore[call-overload]
                trial["resumed_newest"] = got is not None and got == trial["newest"] == trial["ledger_step"]
                k_in_force = int(trial["k"] or 0)  # type: ignore[call-overload]
                trial["strict"] = trial["lost"] is not None and int(trial["lost"]) <= k_in_force  # type: ignore[call-overload]
                bound = max(k_in_force + int(trial["in_flight_steps"]), int(trial["since_resume"]))  # type: ignore[call-overload]
                want_tier = {"memory": "memory", "disk": "dirpath", "none": None}[str(trial["expected_tier"])]
                trial["tier_ok"] = trial["tier"] == want_tier
                trial["partial"] = got not in [0, *trial["ok_steps"]]  # type: ignore[misc]
                trial["within_k"] = trial["lost"] is not None and int(trial["lost"]) <= bound  # type: ignore[call-overload]
                # the engine's own claim: a node loss costs at most the bound it logged (it waits
                # at the bound rather than run past it); before its first one, the steps run
                in_force = trial["since_resume"] if trial["bound"] is None else trial["bound"]
                trial["within_bound"] = trial["lost"] is not None and int(trial["lost"]) <= int(in_force)  # type: ignore[call-overload]
                trials.append(trial)
                print(f"trial {i + 1}: {json.dumps(trial)}", flush=True)
            codes = job.wait(900)
            final = job.result(0) or {}
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    identical = codes == {0: 0, 1: 0} and final.get("weights") == reference and final.get("step") == cfg.max_steps
    cut, gone, what = ("cut", "both sides", "partition") if cfg.fault == "partition" else ("kill", "survivor", "loss")
    rows = [[str(i + 1), str(t["moment"]), f"node {t['victim']}", str(t["seen"]), str(t["resumed"]), str(t["lost"]),
             str(t["k"]), "yes" if t["strict"] else "no", str(t["bound"]), "yes" if t["within_bound"] else "NO",
             f"{t['tier']} ({t['expected_tier']})",
             "yes" if t["resumed_newest"] else "NO", f"{t['exit_s']:.2f}" if t["exit_s"] is not None else "hung",
             str(t["survivor_code"]), str(t["failure_records"])] for i, t in enumerate(trials)]  # fmt: skip
    header = ["trial", "hit during", "killed", "step seen", "resumed at", "steps lost", "K in force", "lost <= K",
              "bound in force", "lost <= bound", "resumed tier (expected)", "resumed newest", f"{cut} -> {gone} gone s", "survivor exit",
              "failure records"]  # fmt: skip
    lost = [int(t["lost"]) for t in trials if t["lost"] is not None]  # type: ignore[call-overload]
    exits = [float(t["exit_s"]) for t in trials if t["exit_s"] is not None]  # type: ignore[arg-type]
    summary = [
        f"steps lost: max {max(lost, default=-1)}; <= the bound the engine logged (or the steps since the resume, "
        f"before the first): {sum(bool(t['within_bound']) for t in trials)}/{len(trials)}; "
        f"<= K: {sum(bool(t['strict']) for t in trials)}/{len(trials)}; "
        f"<= K + the steps of the copy in flight at the kill (or the steps since the resume, before this launch's "
        f"first copy): {sum(bool(t['within_k']) for t in trials)}/{len(trials)} (disk tier every {cfg.every} steps)",
        f"resumed from tier 0 (ledger): {sum(t['tier'] == 'memory' for t in trials)}/{len(trials)}; the tier "
        f"expected from what the loss left: {sum(bool(t['tier_ok']) for t in trials)}/{len(trials)}",
        f"resumed the newest checkpoint that verifies independently (disk + the memory the {what} left): "
        f"{sum(bool(t['resumed_newest']) for t in trials)}/{len(trials)}; partial or mixed states resumed (a step "
        f"with no such checkpoint; a mix of ranks would break the final weights): "
        f"{sum(bool(t['partial']) for t in trials)} of {len(trials)}",
        f"final weights bit-identical to the uninterrupted run (same world size): {'yes' if identical else 'NO'}",
        f"{cut} -> {gone} gone: max {max(exits, default=float('nan')):.2f} s, "
        f"{sum(e <= 10 for e in exits)}/{len(trials)} within 10 s; trials with exactly one failure record (one "
        f"side won it: no split brain): {sum(t['failure_records'] == 1 for t in trials)}/{len(trials)}",
    ]
    title = "A partition" if cfg.fault == "partition" else "Node loss"
    report(cfg, argv, t0, f"{title} across two hosts with tier 0 (bench_node_loss.py --tier0 --nodes 2"
           f"{' --fault partition' if cfg.fault == 'partition' else ''})",
           table(header, rows), summary, {"trials": trials, "identical": identical})  # fmt: skip
    return work_verdict(work, identical and all(bool(t["resumed_newest"] and t["within_bound"] and t["tier_ok"])
                                                and t["exit_s"] is not None and float(t["exit_s"]) <= 10  # type: ignore[arg-type]
                                                for t in trials))


def main_n_minus_1(cfg: argparse.Namespace, argv: list[str] | None, report: Callable[..., None]) -> int:
    """``--n-minus-1``: one trial of the same kind, node 1 lost with its memory, and the job
    restarted on node 0 alone (world 2 -> 1), as an elastic job goes on without a node. With
    two nodes node 0 holds the whole copy, so the resume must come from tier 0 at the newest
    step that verifies there or on the disk, resharded to one rank, and train to the end.
    Sample order is not checked here (train_script.py records no sample indices):
    docs/elastic.md, "Data at a resize", and tests/e2e/test_elastic.py check that for the
    disk tier; tier 0 is the same format and the same load."""
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="lp-node-loss-n1-"))
    memory = Path("/dev/shm") / work.name
    cfg.fixed_k = None if cfg.tier0 == "auto" else int(cfg.tier0)
    cfg.victim = 1
    args = job_args(cfg, memory)
    try:
        with Hosts(2) as hosts:
            trial = one_trial(cfg, hosts, NodeJob(hosts, work / "run", [0, 1], args, memory=memory), memory, rng)
            again = NodeJob(hosts, work / "run", [0], args, memory=memory)  # node 0 alone: world size 1
            codes = again.wait(900)
            result = again.result(0) or {}
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    ledger_step, tier = ledger_tier(work / "run" / "ckpt", 1)
    got = result.get("start_step")
    lost = int(trial["seen"]) - got if got is not None else None  # type: ignore[call-overload]
    newest = got is not None and got == trial["newest"] == ledger_step
    tier_ok = tier == {"memory": "memory", "disk": "dirpath", "none": None}[str(trial["expected_tier"])]
    ended = codes == {0: 0} and result.get("step") == cfg.max_steps
    rows = [[str(trial["moment"]), "node 1", str(trial["seen"]), str(got), str(lost), str(trial["k"]),
             f"{tier} ({trial['expected_tier']})", "yes" if newest else "NO", "1",
             f"{result.get('step')} ({'yes' if ended else 'NO'})"]]  # fmt: skip
    header = ["hit during", "killed", "step seen", "resumed at (world 1)", "steps lost", "K in force",
              "resumed tier (expected)", "resumed newest", "world after", f"final step (= {cfg.max_steps})"]  # fmt: skip
    summary = [f"resumed on one node from {tier} at step {got}, the newest that verifies on node 0 or the disk: "
               f"{'yes' if newest and tier_ok else 'NO'}; trained to the end at world size 1: {'yes' if ended else 'NO'}",
               "sample order: not checked here (see the function's docstring)"]  # fmt: skip
    report(cfg, argv, t0, "N-1 after a node lost with its memory (bench_node_loss.py --tier0 --n-minus-1)",
           table(header, rows), summary, {"trial": trial, "result": result, "tier": tier})  # fmt: skip
    return work_verdict(work, newest and tier_ok and ended)
