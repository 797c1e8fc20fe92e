"""Whole-node loss without a signal: SIGKILL every process of one host at a random moment.

Two hosts in Linux network namespaces (tests/support/netns.py; root and iproute2), one
torchrun agent each (tests/support/netns_job.py), the fault-injection job
(``tests/support/train_script.py``: TinyModel, ``PreemptionCallback`` saving every
``--every`` steps, failure detection on by default at 2 ranks). One chain of launches, as a
scheduler restarts a job: each launch is the victim of one trial and the restart that
measures the previous one. A trial waits for a random moment — during steps (1..2*every
past the resume point) or just after a periodic save began (0-30 ms after its step; "flush
seen" when its directory had no manifest yet at the kill) — and SIGKILLs every process of a random node (0 also hosts the rendezvous and
rank 0). Per trial:

* **detect -> exit**: from the kill until the survivor's worker is gone (target <= 10 s);
* **steps lost**: max step seen at the kill - the step the restart resumed from;
* **resumed newest**: the restart's choice (its "resuming from" line) is the newest
  checkpoint that verifies independently (tests/support/fault_injection.py's ``scan``: manifest,
  every file's size and CRC32C), never a partial directory;
* the survivor's exit code (75) and its failure record in the ledger.

The chain's last launch trains to the end; its final weights are compared with a run that
was never interrupted (same world size: bit-identical expected).

    python benchmarks/bench_node_loss.py                 # 3 trials, ~3 min here
    python benchmarks/bench_node_loss.py --trials 20 --md docs/benchmarks.md

``--tier0 auto`` (or a K): tier 0 (docs/tier0.md) on one host, one rank: each trial SIGKILLs
every process of the node during steps or during a tier-0 copy (an uncommitted directory
seen in the tmpfs) and restarts on the same node, whose ``/dev/shm`` outlived the kill.
Per trial: steps lost (target <= the K in force at the kill: the one the engine logged, or a
fixed K), and whether the restart resumed the newest checkpoint that verifies independently
across the disk tier *and* tier 0 (never a partial or mixed one).

    python benchmarks/bench_node_loss.py --tier0 auto --trials 20 --every 1000

Needs root and iproute2 (network namespaces); without them it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine_notes, table
from fault_injection import RESUME_RE, bound_in_force, failure_records, newest_ok, scan
from netns import Hosts, missing
from netns_job import NodeJob


def work_verdict(work: Path, ok: bool) -> int:
    """The exit code; the work directory (checkpoints, the jobs' logs) removed when the run
    passed, kept and named on stderr when it did not: what went wrong is in there."""
    if ok:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"benchmark failed: its work directory (checkpoints, job logs) is kept in {work}", file=sys.stderr)
    return 1


def job_args(cfg: argparse.Namespace) -> list[str]:
    return ["--max-steps", str(cfg.max_steps), "--every", str(cfg.every), "--step-sleep", str(cfg.step_sleep),
            "--width", str(cfg.width), "--ledger-progress-s", "0.5"]  # fmt: skip


def resumed_step(job: NodeJob) -> int | None:
    found = RESUME_RE.findall(job.log(job.nodes[0]) + "\n" + "\n".join(job.log(n) for n in job.nodes[1:]))
    return int(found[-1][1]) if found else None


def in_flight(job: NodeJob) -> bool:
    """A ``step-N`` directory without its manifest: a save is flushing."""
    return any(d.name.lstrip(".").startswith("step-") and not (d / "manifest.json").exists() for d in job.dirpath.iterdir())


def one_trial(cfg: argparse.Namespace, hosts: Hosts, job: NodeJob, rng: random.Random) -> dict[str, object]:
    start = max(0, resumed_step(job) or 0)
    moment = rng.choice(["steps", "save"])
    if moment == "save":  # just after a periodic save began: its flush runs behind the next steps
        job.wait_step((start // cfg.every + 1 + rng.randint(0, 1)) * cfg.every)
        time.sleep(rng.uniform(0, 0.03))
        if in_flight(job):
            moment = "save (flush seen)"
    else:
        job.wait_step(min(cfg.max_steps - 2, start + rng.randint(1, 2 * cfg.every)))
        time.sleep(rng.uniform(0, cfg.step_sleep))
    victim = rng.choice([0, 1])
    seen = max(job.step(r) for r in (0, 1))
    hosts.kill_node(victim)
    survivor = 1 - victim
    gone = job.wait_gone([survivor], timeout=60)
    codes = job.wait(60)
    ok = newest_ok(scan(job.dirpath))
    return {"moment": moment, "victim": victim, "seen": seen, "exit_s": gone, "survivor_code": codes.get(survivor),
            "newest": ok.step if ok is not None else None, "failure_records": failure_records(job.dirpath)}  # fmt: skip


K_RE = re.compile(r"(?:tier 0 copies|a copy) every (\d+) steps")  # chosen, or carried with the bound


def tier0_trial(cfg: argparse.Namespace, hosts: Hosts, job: NodeJob, memory: Path, rng: random.Random) -> dict[str, object]:
    """Kill the node during steps or during a tier-0 copy; what the restart must reach."""
    start = max(0, resumed_step(job) or 0)
    deadline = time.monotonic() + 240
    while newest_ok(scan(job.dirpath) + scan(memory)) is None:  # a first launch: its first copy commits first
        assert time.monotonic() < deadline, "no checkpoint committed\n" + job.log(0)
        time.sleep(0.05)
    moment = rng.choice(["steps", "tier-0 copy"])
    k_now = lambda: int(K_RE.findall(job.log(0))[-1]) if K_RE.findall(job.log(0)) else cfg.fixed_k  # noqa: E731
    if moment == "tier-0 copy":  # a steady-state copy: after this launch chose its K
        deadline = time.monotonic() + 120
        job.wait_step(start + 1)
        while K_RE.search(job.log(0)) is None and cfg.fixed_k is None:
            assert time.monotonic() < deadline and job.step(0) < cfg.max_steps - 2, "no K chosen\n" + job.log(0)
            time.sleep(0.05)
        while not any(d.is_dir() and not (d / "manifest.json").exists() for d in memory.glob("step-*")):
            assert time.monotonic() < deadline and job.step(0) < cfg.max_steps - 2, "no tier-0 copy seen in flight"
            time.sleep(0.005)
    else:
        k = k_now() or 10
        job.wait_step(min(cfg.max_steps - 2, start + rng.randint(1 if start else 8, 2 * k)))
        time.sleep(rng.uniform(0, cfg.step_sleep))
    seen, k, bound = job.step(0), k_now(), bound_in_force(job.log(0))
    hosts.kill_node(0)
    job.wait(60)
    candidates = [c for c in scan(job.dirpath) + scan(memory) if c.status == "ok"]
    ok = newest_ok(candidates)
    return {"moment": moment, "victim": 0, "seen": seen, "k": k, "bound": bound, "since_resume": seen - start,
            "exit_s": None,
            "survivor_code": None, "newest": ok.step if ok is not None else None, "failure_records": 0}  # fmt: skip


def main_tier0(cfg: argparse.Namespace, argv: list[str] | None) -> int:
    """``--tier0``: one host, SIGKILL of the whole node, restart on the same node."""
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="lp-node-loss-tier0-"))
    memory = Path("/dev/shm") / work.name
    cfg.fixed_k = None if cfg.tier0 == "auto" else int(cfg.tier0)
    args = [*job_args(cfg), "--cb-kwargs", json.dumps({"tier0_every_n_steps": cfg.fixed_k or "auto",
                                                        "memory_dirpath": str(memory)})]  # fmt: skip
    trials: list[dict[str, object]] = []
    try:
        with Hosts(1) as hosts:
            job = NodeJob(hosts, work / "run", [0], args)
            for i in range(cfg.trials):
                trial = tier0_trial(cfg, hosts, job, memory, rng)
                job = NodeJob(hosts, work / "run", [0], args)
                deadline = time.monotonic() + 300
                while (got := resumed_step(job)) is None and job.step(0) < 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                got = resumed_step(job) if got is None else got
                got = 0 if got is None and job.step(0) >= 0 else got  # trained from scratch: nothing to resume
                trial["resumed"] = got
                trial["lost"] = max(0, int(trial["seen"]) - got) if got is not None else None  # type: ignore[call-overload]
                trial["resumed_newest"] = got is not None and got == trial["newest"]
                bound = max(int(trial["k"] or 0), int(trial["since_resume"]))  # type: ignore[call-overload]
                trial["within_k"] = trial["lost"] is not None and int(trial["lost"]) <= bound  # type: ignore[call-overload]
                # the engine's claim: at most the bound it logged (before the first: the steps run)
                in_force = trial["since_resume"] if trial["bound"] is None else trial["bound"]
                trial["within_bound"] = trial["lost"] is not None and int(trial["lost"]) <= int(in_force)  # type: ignore[call-overload]
                trials.append(trial)
                print(f"trial {i + 1}: {json.dumps(trial)}", flush=True)
            hosts.kill_node(0)
            job.wait(60)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    rows = [[str(i + 1), str(t["moment"]), str(t["seen"]), str(t["resumed"]), str(t["lost"]), str(t["k"]),
             "yes" if t["within_k"] else "NO", str(t["bound"]), "yes" if t["within_bound"] else "NO",
             "yes" if t["resumed_newest"] else "NO"] for i, t in enumerate(trials)]  # fmt: skip
    header = ["trial", "hit during", "step seen", "resumed at", "steps lost", "K in force", "lost <= K",
              "bound in force", "lost <= bound", "resumed newest"]  # fmt: skip
    lost = [int(t["lost"]) for t in trials if t["lost"] is not None]  # type: ignore[call-overload]
    summary = [
        f"steps lost: max {max(lost, default=-1)}; within K (or the steps since the resume, before this launch's "
        f"first copy): {sum(bool(t['within_k']) for t in trials)}/{len(trials)} (disk tier every {cfg.every} steps)",
        f"partial or mixed states resumed: {sum(not t['resumed_newest'] for t in trials)} of {len(trials)}",
    ]
    _report(cfg, argv, t0, "Node loss with tier 0 (bench_node_loss.py --tier0)", table(header, rows), summary,
            {"trials": trials})  # fmt: skip
    return work_verdict(work, all(bool(t["resumed_newest"] and t["within_bound"]) for t in trials))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=0, help="default: enough for every trial")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--width", type=int, default=32768, help="TinyModel width (32768: ~1.5 MB of state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--md", default="", help="append the table and the command to this markdown file")
    p.add_argument("--json", default="")
    p.add_argument("--tier0", default="", help="auto or K: tier 0 on one host (see the module docstring)")
    cfg = p.parse_args(argv)
    cfg.max_steps = cfg.max_steps or (cfg.trials + 1) * 2 * cfg.every + 5
    if cfg.tier0:
        cfg.max_steps = 10**6  # every launch is killed, the last one too
    why = missing()
    if why is not None:
        print(f"bench_node_loss: skipped: {why}")
        return 0
    if cfg.tier0:
        return main_tier0(cfg, argv)
    rng = random.Random(cfg.seed)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="lp-node-loss-"))
    trials: list[dict[str, object]] = []
    with Hosts(2) as hosts:
        ref = NodeJob(hosts, work / "reference", [0, 1], job_args(cfg))
        assert ref.wait(600) == {0: 0, 1: 0}, ref.log(0)
        reference = (ref.result(0) or {}).get("weights")
        job = NodeJob(hosts, work / "run", [0, 1], job_args(cfg))
        for i in range(cfg.trials):
            trial = one_trial(cfg, hosts, job, rng)
            job = NodeJob(hosts, work / "run", [0, 1], job_args(cfg))  # the scheduler restarts both nodes
            deadline = time.monotonic() + 300
            while (got := resumed_step(job)) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            trial["resumed"] = got
            trial["lost"] = max(0, int(trial["seen"]) - got) if got is not None else None  # type: ignore[call-overload]
            trial["resumed_newest"] = got is not None and got == trial["newest"]
            trials.append(trial)
            print(f"trial {i + 1}: {json.dumps(trial)}", flush=True)
        codes = job.wait(600)
        final = job.result(0) or {}
    identical = codes == {0: 0, 1: 0} and final.get("weights") == reference and final.get("step") == cfg.max_steps
    rows = [[str(i + 1), str(t["moment"]), f"node {t['victim']}", str(t["seen"]), str(t["resumed"]), str(t["lost"]),
             "yes" if t["resumed_newest"] else "NO", f"{t['exit_s']:.2f}" if t["exit_s"] is not None else "hung",
             str(t["survivor_code"]), str(t["failure_records"])] for i, t in enumerate(trials)]  # fmt: skip
    header = ["trial", "hit during", "killed", "step seen", "resumed at", "steps lost", "resumed newest",
              "kill -> survivor gone s", "survivor exit", "failure records"]  # fmt: skip
    lost = [int(t["lost"]) for t in trials if t["lost"] is not None]  # type: ignore[call-overload]
    exits = [float(t["exit_s"]) for t in trials if t["exit_s"] is not None]  # type: ignore[arg-type]
    summary = [
        f"steps lost: max {max(lost, default=-1)} (target <= every_n = {cfg.every}; a kill during a flush can "
        f"lose that save too: <= {2 * cfg.every})",
        f"partial or mixed states resumed: {sum(not t['resumed_newest'] for t in trials)} of {len(trials)}",
        f"final weights bit-identical to the uninterrupted run (same world size): {'yes' if identical else 'NO'}",
        f"kill -> survivor gone: max {max(exits, default=float('nan')):.2f} s, "
        f"{sum(e <= 10 for e in exits)}/{len(trials)} within 10 s",
    ]
    _report(cfg, argv, t0, "Node loss without a signal (bench_node_loss.py)", table(header, rows), summary,
            {"trials": trials, "identical": identical})  # fmt: skip
    return work_verdict(work, identical and all(bool(t["resumed_newest"]) for t in trials))


def _report(cfg: argparse.Namespace, argv: list[str] | None, t0: float, title: str, body: str,
            summary: list[str], data: dict[str, object]) -> None:  # fmt: skip
    """Print the run's table and summary; append them to ``--md`` under ``title``, the trials to ``--json``."""
    command = "python benchmarks/bench_node_loss.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"Command: `{command.strip()}`  \nRun: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{machine_notes()}; {time.monotonic() - t0:.0f} s\n\n{body}\n\n"
            + "\n".join(f"- {s}" for s in summary) + "\n")  # fmt: skip
    print(text)
    if cfg.md:
        with open(cfg.md, "a") as f:
            f.write(f"\n### {title}\n\n{text}")
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(data, indent=1))

if __name__ == "__main__":
    sys.exit(main())
