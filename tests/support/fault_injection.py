"""Fault injection: SIGTERM and SIGKILL a real training job at random moments, restart it
like a scheduler would, and check what the restart resumed from.

The job is ``tests/support/train_script.py`` (TinyModel, deterministic data, ``PreemptionCallback``
saving every ``--every`` steps, ``ShardedAsyncCheckpointIO``). One chain of launches: each
launch is the victim of one trial *and* the restart that measures the previous trial (a
scheduler restarts the job after every preemption). A trial:

1. launch (or reuse the previous trial's restart), wait for a random moment of the chosen
   phase, send the signal to one rank (a random rank with ``--ddp``):

   - ``steps``:   after a random number of steps (1..2*every past the resume point), plus a
     random fraction of a step;
   - ``flush``:   as soon as a periodic save is in flight (a new ``step-N`` directory without
     ``manifest.json`` appears), plus a small random delay;
   - ``startup``: after the rank's pid file appears (our handler is installed) and before
     its first step file: during restore / strategy set-up / train start;

2. wait for the exit (timeouts: a job that does not exit is "hung") and check the exit
   code: 143 on every rank for SIGTERM, -9 for SIGKILL (under DDP the launcher's child
   observer turns a dead rank into SIGKILL for the others; ranks that outlive a killed
   rank 0 are torn down by the harness, as a scheduler would);
3. inspect the checkpoint directory independently of the package (manifest present, every
   listed file present with its size and CRC32C): the newest valid committed step;
4. restart; the restart's resume point is read from its log line ("resuming from <dir>
   (step N)") or, for the verification run that ends a chain segment, from
   ``rank{R}.result.json``'s ``start_step``; the chosen directory must be the newest valid.

Steps lost = (step when the signal was sent: max over ranks of the step files just before
sending; for a start-up signal the step the job was restoring) - (step the restart resumed
from), floored at 0. Goals: every restart resumes from the newest committed checkpoint;
0 steps lost per SIGTERM; <= ``--every`` steps lost per SIGKILL.

    python tests/support/fault_injection.py --n 30                 # single process, ~10 min
    python tests/support/fault_injection.py --n 10 --ddp           # 2 ranks (gloo), ~7 min
    python tests/support/fault_injection.py --n 2 --json out.json  # the CI sample
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import crc32c

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "train_script.py"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import RankFiles, git_revision, kill_group, launch, machine_notes, table, wait_gone, wait_until  # noqa: E402

PHASES = ("steps", "flush", "startup")
EXPECTED_CODE = {"sigterm": 143, "sigkill": -9}
RESUME_RE = re.compile(r"lightning_preempt: resuming from (\S+) \(step (\d+)\)")
BOUND_RE = re.compile(r"tier 0 bounds a node loss to (\d+) steps")


def failure_records(dirpath: Path) -> int:
    """How many failure records (a lost peer's verdict) the run's ledger under ``dirpath`` holds."""
    return len(list(dirpath.glob(".lp-ledger/*/*-failure.json")))


def bound_in_force(log_text: str) -> int | None:
    """The tier-0 loss bound the engine last logged in this launch's log (docs/tier0.md, "The
    loss bound"); ``None`` before the first one (a first launch before its first copy)."""
    found = BOUND_RE.findall(log_text)
    return int(found[-1]) if found else None


# ------------------------------------------------------------------ checkpoint inspection
@dataclasses.dataclass
class Ckpt:
    name: str
    step: int | None
    status: str  # "ok", "uncommitted", "corrupt: ..."
    mtime: float = 0.0  # of the directory: a new file in it (a save in progress) moves it


def scan(ck: Path) -> list[Ckpt]:
    """Every directory under ``ck``, verified without the package's own code."""
    return scan_union([ck])


def scan_union(roots: list[Path]) -> list[Ckpt]:
    """Every checkpoint directory name under any of ``roots``, verified across them without
    the package's own code: its manifest from any root, each file it lists whole (size and
    CRC32C) in at least one. Tier 0 on several nodes: a copy the nodes hold together, which a
    restart completes on every node before it resumes (tiers/tier0_peer.py ``restore``)."""
    names = sorted({d.name for ck in roots if ck.is_dir() for d in ck.iterdir() if d.is_dir()})
    out: list[Ckpt] = []
    for name in names:
        dirs = [ck / name for ck in roots if (ck / name).is_dir()]
        m = re.search(r"step-(\d+)", name)
        name_step = int(m.group(1)) if m else None
        manifests = [d / "manifest.json" for d in dirs if (d / "manifest.json").exists()]
        if not manifests:
            out.append(Ckpt(name, name_step, "uncommitted", max(_mtime(d) for d in dirs)))
            continue
        try:
            body = json.loads(manifests[0].read_bytes())
            step = int(body["step"])
            # a checkpoint replaced at its path keeps its files in the generation its manifest names
            data_dir = (body.get("extra") or {}).get("data_dir")
            if data_dir is not None and not re.fullmatch(r"v-[0-9a-f]{12}", str(data_dir)):
                raise ValueError(f"invalid data_dir {data_dir!r}")
            for fname, entry in body["files"].items():
                why = _whole_somewhere([d / data_dir if data_dir else d for d in dirs], fname, entry)
                if why is not None:
                    raise ValueError(why)
        except (OSError, ValueError, KeyError) as err:
            out.append(Ckpt(name, name_step, f"corrupt: {err}"))
            continue
        out.append(Ckpt(name, step, "ok"))
    return out


def _whole_somewhere(dirs: list[Path], fname: str, entry: dict[str, object]) -> str | None:
    """``None`` when some directory holds ``fname`` at the manifest's size and CRC32C; else why not."""
    why = f"{fname}: missing"
    for d in dirs:
        try:
            data = (d / fname).read_bytes()
        except OSError as err:
            why = str(err)
            continue
        if len(data) != int(entry["size"]):  # type: ignore[call-overload]
            why = f"{fname}: size {len(data)} != {entry['size']}"
        elif f"{crc32c.crc32c(data):08x}" != entry["crc32c"]:
            why = f"{fname}: CRC32C mismatch"
        else:
            return None
    return why


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def newest_ok(ckpts: list[Ckpt]) -> Ckpt | None:
    ok = [c for c in ckpts if c.status == "ok" and c.step is not None]
    return max(ok, key=lambda c: c.step or 0) if ok else None


# ------------------------------------------------------------------ one launch of the job
class Job(RankFiles):
    def __init__(self, cfg: argparse.Namespace, work: Path, max_steps: int, index: int) -> None:
        super().__init__(work / "st", 2 if cfg.ddp else 1)
        shutil.rmtree(self.status, ignore_errors=True)
        self.status.mkdir(parents=True)
        self.log_path = work / "logs" / f"launch-{index:03d}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        argv = [sys.executable, str(cfg.script), "--dirpath", str(work / "ck"), "--status", str(self.status)]
        argv += ["--max-steps", str(max_steps), "--every", str(cfg.every), "--step-sleep", str(cfg.step_sleep)]
        argv += ["--width", str(cfg.width), "--grace", str(cfg.grace)]
        if cfg.ddp:
            argv += ["--devices", "2", "--strategy", "ddp"]
        self.wall_start = time.time()  # a directory written by this launch has a later mtime
        self.proc = launch(argv, self.log_path, cwd=work, start_new_session=True, env=_child_env(cfg))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> bool:
        """Wait for the launcher and every rank to exit; False on timeout."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        others = [p for p in (self.pid(r) for r in range(1, self.ranks)) if p is not None]
        return wait_gone(others, max(0.0, deadline - time.monotonic())) is not None

    def kill_all(self) -> None:
        kill_group(self.proc, [self.pid(r) for r in range(1, self.ranks)])

    def exit_codes(self) -> list[str]:
        return [self.read(r, "exit") or "-" for r in range(self.ranks)]

    def resumed(self) -> tuple[str | None, int | None, bool]:
        """(chosen dir, step) from the log; the bool says whether the ranks agreed."""
        found = {(m.group(1), int(m.group(2))) for m in RESUME_RE.finditer(self.log_path.read_text(errors="replace"))}
        if not found:
            return None, None, True
        path, step = sorted(found)[0]
        return path, step, len(found) == 1


def _child_env(cfg: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared: one core per rank
    env["PYTHONPATH"] = os.pathsep.join([str(cfg.src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def snapshot(work: Path, attempts: int = 10) -> Path:
    """Copy the package and the job script into ``work/src`` (first on the children's path),
    so that edits to the working tree during a long run do not change the code under test."""
    src = work / "src"
    for _ in range(attempts):
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(
            ROOT / "lightning_preempt", src / "lightning_preempt", ignore=shutil.ignore_patterns("__pycache__")
        )
        shutil.copy2(SCRIPT, src / "train_script.py")
        shutil.copy2(SCRIPT.parent / "models.py", src / "models.py")  # the job's model and data
        env = dict(os.environ, PYTHONPATH=str(src))
        probe = (
            "import lightning_preempt, sys; sys.exit(0 if lightning_preempt.__file__.startswith(sys.argv[1]) else 3)"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe, str(src)], cwd=work, env=env, capture_output=True, check=False
        )
        if done.returncode == 0:
            return src
        time.sleep(5)  # caught a half-finished edit: try again
    raise SystemExit(f"the package in {ROOT} does not import:\n{done.stderr.decode(errors='replace')[-2000:]}")


# ------------------------------------------------------------------ trials
@dataclasses.dataclass
class Trial:
    index: int
    kind: str
    phase: str  # the phase aimed at
    rank: int
    hit: str = ""  # the phase observed when the signal was sent
    sent_step: int | None = None
    baseline: int | None = None  # newest valid committed step before the victim launched
    exit_code: int | None = None
    rank_exits: list[str] = dataclasses.field(default_factory=list)
    exit_s: float | None = None
    hung: bool = False
    torn_down: bool = False
    expected_resume: int | None = None  # newest valid committed step after the exit
    newest_left: str = ""  # status of the newest directory left behind
    resumed: int | None = None
    resumed_path: str | None = None
    resumed_via: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def exit_ok(self) -> bool:
        if self.kind == "sigkill" and self.rank != 0:
            # DDP: the launcher is rank 0; it fails on the dead peer (gloo: exit 1) or is
            # SIGKILLed by Lightning's child-process observer (-9)
            return self.exit_code in (-9, 1)
        return self.exit_code == EXPECTED_CODE[self.kind]

    @property
    def lost(self) -> int | None:
        if self.sent_step is None or self.resumed is None:
            return None
        return max(0, self.sent_step - self.resumed)

    @property
    def resumed_newest(self) -> bool:
        return self.resumed is not None and self.resumed == (self.expected_resume or 0)


class Runner:
    def __init__(self, cfg: argparse.Namespace, work: Path) -> None:
        self.cfg = cfg
        self.work = work
        self.ck = work / "ck"
        self.rng = random.Random(cfg.seed)
        self.launches = 0
        self.startup_gap: list[float] = []  # pid file -> first step file, seconds
        self.step_s: list[float] = []

    def launch(self, max_steps: int) -> Job:
        self.launches += 1
        return Job(self.cfg, self.work, max_steps, self.launches)

    # ---- the waits before the signal ---------------------------------------------------
    def _aim(self, job: Job, trial: Trial, baseline: int) -> bool:
        """Wait for the trial's moment; False when the job never got there."""
        cfg = self.cfg
        rank = trial.rank
        if trial.phase == "startup":
            if not wait_until(lambda: job.pid(rank) is not None, job.proc, cfg.timeout):
                return False
            gap = sorted(self.startup_gap)[len(self.startup_gap) // 2] if self.startup_gap else 0.5
            time.sleep(self.rng.uniform(0.0, 0.9 * gap))
            return True
        # learn the start-up window (pid file -> first step file) for start-up trials
        if wait_until(lambda: job.pid(rank) is not None, job.proc, cfg.timeout):
            t_pid = time.monotonic()
            if wait_until(lambda: bool(job.steps()), job.proc, cfg.timeout):
                self.startup_gap.append(time.monotonic() - t_pid)
        if trial.phase == "steps":
            target = baseline + self.rng.randint(1, 2 * cfg.every)

            def there() -> bool:
                steps = job.steps()
                return len(steps) == job.ranks and min(steps) >= target

            if not wait_until(there, job.proc, cfg.timeout):
                return False
            time.sleep(self.rng.uniform(0.0, cfg.step_sleep))
            return True
        # flush: a new checkpoint directory without a manifest
        before = {p.name for p in self.ck.iterdir()} if self.ck.is_dir() else set()

        def in_flight() -> bool:
            if not self.ck.is_dir():
                return False
            return any(
                p.name not in before and not (p / "manifest.json").exists() for p in self.ck.iterdir() if p.is_dir()
            )

        if not wait_until(in_flight, job.proc, cfg.timeout):
            return False
        time.sleep(self.rng.uniform(0.0, cfg.flush_delay))
        return True

    def _observed_phase(self, job: Job, baseline: int) -> str:
        if len(job.steps()) < job.ranks:
            return "startup"
        for c in scan(self.ck):
            # written by this launch (not a partial left by an earlier SIGKILL)
            if c.status == "uncommitted" and (c.step or 0) > baseline and c.mtime >= job.wall_start:
                return "flush"
        return "steps"

    # ---- one victim launch -------------------------------------------------------------
    def victim(self, trial: Trial, pending: Trial | None) -> None:
        cfg = self.cfg
        before = newest_ok(scan(self.ck))
        baseline = before.step if before and before.step is not None else 0
        trial.baseline = baseline
        job = self.launch(max_steps=baseline + 1000)
        reached = self._aim(job, trial, baseline)
        if not reached:
            trial.problems.append(f"job never reached the {trial.phase} moment (exit {job.proc.poll()})")
            trial.hit = "none"
        else:
            steps = job.steps()
            trial.hit = self._observed_phase(job, baseline)
            trial.sent_step = max(steps) if steps else baseline
            pid = job.pid(trial.rank)
            assert pid is not None
            sig = signal.SIGTERM if trial.kind == "sigterm" else signal.SIGKILL
            sent = time.monotonic()
            os.kill(pid, sig)
        # wait for the exit
        limit = cfg.grace + 30 if trial.kind == "sigterm" else 20
        if reached and not job.wait(limit):
            if trial.kind == "sigkill" and cfg.ddp:
                trial.torn_down = True  # ranks outliving a killed rank: the scheduler ends the job
            else:
                trial.hung = True
                trial.problems.append(f"did not exit within {limit:.0f}s after the signal")
            job.kill_all()
        elif not reached:
            job.kill_all()
        if reached:
            trial.exit_s = time.monotonic() - sent
        trial.exit_code = job.proc.returncode
        trial.rank_exits = job.exit_codes()
        if reached and not trial.hung and not trial.torn_down:
            want = EXPECTED_CODE[trial.kind]
            if not trial.exit_ok:
                trial.problems.append(f"launcher exit code {trial.exit_code}, expected {want}")
            if trial.kind == "sigterm" and trial.rank_exits != [str(want)] * job.ranks:
                trial.problems.append(f"rank exit records {trial.rank_exits}, expected {want} on every rank")
            if trial.kind == "sigterm" and trial.exit_s is not None and trial.exit_s > cfg.grace:
                trial.problems.append(f"exited {trial.exit_s:.1f}s after SIGTERM, over the {cfg.grace:.0f}s grace")
        # this launch was also the restart of the previous trial
        if pending is not None:
            self.measure_restart(pending, job)
        # what the restart must pick
        left = scan(self.ck)
        after = newest_ok(left)
        trial.expected_resume = after.step if after else None
        newest_dir = max(left, key=lambda c: c.step or -1) if left else None
        trial.newest_left = f"{newest_dir.name}: {newest_dir.status}" if newest_dir else "none"
        stale = newest_dir is not None and newest_dir.status == "uncommitted" and newest_dir.mtime < job.wall_start
        if stale and newest_dir is not None:
            trial.newest_left += " (left by an earlier launch)"
        if trial.kind == "sigterm" and newest_dir is not None and newest_dir.status != "ok" and not stale:
            trial.problems.append(f"SIGTERM left the newest checkpoint {trial.newest_left}")

    def measure_restart(self, trial: Trial, job: Job) -> None:
        path, step, agreed = job.resumed()
        if not agreed:
            trial.problems.append("the ranks logged different resume points")
        if path is None and job.steps():
            path, step = None, 0  # it trained from scratch
        if step is None:
            trial.problems.append("the restart died before logging its resume point")
            return
        trial.resumed, trial.resumed_path, trial.resumed_via = step, path, "log"
        self._check_choice(trial)

    def _check_choice(self, trial: Trial) -> None:
        if trial.resumed_path is not None:
            name = Path(trial.resumed_path).name
            found = [c for c in scan(self.ck) if c.name == name]
            status = found[0].status if found else "gone"
            # retention may have removed it after the restart's own saves; only judge what is there
            if status not in ("ok", "gone"):
                trial.problems.append(f"resumed from {name}, which is {status}")
        if not trial.resumed_newest:
            trial.problems.append(
                f"resumed from step {trial.resumed}, newest valid committed was {trial.expected_resume}"
            )

    def verify_run(self, trial: Trial) -> None:
        """A restart that runs to its (short) max_steps: result.json gives the start step."""
        cfg = self.cfg
        start = trial.expected_resume or 0
        job = self.launch(max_steps=start + 2)
        if not job.wait(cfg.timeout):
            trial.problems.append(f"the verification restart hung (> {cfg.timeout:.0f}s)")
            job.kill_all()
        if job.proc.returncode != 0:
            trial.problems.append(f"the verification restart exited {job.proc.returncode}")
        starts, paths = set(), set()
        for r in range(job.ranks):
            text = job.read(r, "result.json")
            if text is None:
                trial.problems.append(f"rank {r} wrote no result.json")
                continue
            res = json.loads(text)
            starts.add(res["start_step"])
            paths.add(res["resumed_from"])
            if res["step"] != start + 2:
                trial.problems.append(f"rank {r} ended at step {res['step']}, not {start + 2}")
        if len(starts) != 1:
            trial.problems.append(f"ranks started at different steps {sorted(starts)}")
            return
        trial.resumed = starts.pop()
        trial.resumed_path = paths.pop() if len(paths) == 1 else None
        trial.resumed_via = "result.json"
        self._check_choice(trial)

    def run(self, schedule: list[Trial], progress: bool = True) -> list[Trial]:
        pending: Trial | None = None
        for trial in schedule:
            # A start-up victim may die before it logs where it resumed, and a failed trial
            # needs a clean restart: measure the pending trial with a run to completion.
            if pending is not None and (trial.phase == "startup" or pending.problems):
                self.verify_run(pending)
                self._report(pending, progress)
                pending = None
            self.victim(trial, pending)
            if pending is not None:
                self._report(pending, progress)
            pending = trial
        if pending is not None:
            self.verify_run(pending)
            self._report(pending, progress)
        return schedule

    def _report(self, t: Trial, progress: bool) -> None:
        if not progress:
            return
        flag = "ok" if not t.problems else "PROBLEM: " + "; ".join(t.problems)
        print(
            f"[{t.index:3d}] {t.kind:7s} aim={t.phase:7s} hit={t.hit:7s} rank={t.rank} sent@{t.sent_step} "
            f"exit={t.exit_code} ranks={','.join(t.rank_exits)} newest={t.expected_resume} "
            f"resumed={t.resumed} ({t.resumed_via}) lost={t.lost} {flag}",
            flush=True,
        )


# ------------------------------------------------------------------ report
def summarize(trials: list[Trial], cfg: argparse.Namespace) -> dict[str, Any]:
    rows = []
    keys = sorted({(t.kind, t.hit) for t in trials}, key=lambda k: (k[0], PHASES.index(k[1]) if k[1] in PHASES else 9))
    for kind, hit in keys:
        ts = [t for t in trials if t.kind == kind and t.hit == hit]
        lost = [t.lost for t in ts if t.lost is not None]
        rows.append(
            [
                kind.upper(),
                hit,
                str(len(ts)),
                f"{sum(t.resumed_newest for t in ts)}/{len(ts)}",
                f"{sum(lost) / len(lost):.2f}" if lost else "—",
                str(max(lost)) if lost else "—",
                f"{sum(t.exit_ok for t in ts)}/{len(ts)}",
                f"{max((t.exit_s or 0) for t in ts):.1f}",
                str(sum(t.hung for t in ts)),
                str(sum(t.torn_down for t in ts)),
                str(sum(bool(t.problems) for t in ts)),
            ]
        )
    header = [
        "signal",
        "hit during",
        "trials",
        "resumed newest",
        "lost mean",
        "lost max",
        "exit code ok",
        "max exit s",
        "hung",
        "torn down",
        "problems",
    ]
    term = [t for t in trials if t.kind == "sigterm"]
    kill = [t for t in trials if t.kind == "sigkill"]
    verdicts = []
    newest_ok_n = sum(t.resumed_newest for t in trials)
    verdicts.append(
        (
            "resumed_newest",
            newest_ok_n == len(trials),
            f"resumed from the newest committed step: {newest_ok_n}/{len(trials)}",
        )
    )
    if term:
        lost = [t.lost for t in term if t.lost is not None]
        ok = len(lost) == len(term) and max(lost) == 0
        verdicts.append(("sigterm_lost", ok, f"steps lost per SIGTERM: max {max(lost) if lost else '—'} (goal 0)"))
    if kill:
        lost = [t.lost for t in kill if t.lost is not None]
        # Between saves a SIGKILL loses at most `every` steps. During a flush the save in flight
        # is lost too; at most one is in flight (the next save waits for it), so the newest
        # commit is at most 2*every steps back (a first save still flushing on a loaded
        # machine: its step and those after it).
        bounds = [cfg.every if t.hit != "flush" else 2 * cfg.every for t in kill if t.lost is not None]
        ok = len(lost) == len(kill) and all(n <= b for n, b in zip(lost, bounds))
        verdicts.append(
            (
                "sigkill_lost",
                ok,
                f"steps lost per SIGKILL: max {max(lost) if lost else '—'} (goal <= every={cfg.every} between "
                f"saves, <= 2*every={2 * cfg.every} during a flush)",
            )
        )
    bad = [t for t in trials if t.problems]
    verdicts.append(("no_problems", not bad, f"runs failed / hung / unexpected exit / wrong checkpoint: {len(bad)}"))
    return {
        "table": table(header, rows),
        "verdicts": [{"name": n, "met": ok, "text": text} for n, ok, text in verdicts],
        "problems": [{"trial": t.index, "kind": t.kind, "hit": t.hit, "problems": t.problems} for t in bad],
        "trials": [dataclasses.asdict(t) | {"lost": t.lost, "resumed_newest": t.resumed_newest} for t in trials],
    }


def render(summary: dict[str, Any], cfg: argparse.Namespace, command: str, elapsed: float, launches: int) -> str:
    lines = [
        f"### {'DDP, 2 ranks (gloo), signal to a random rank' if cfg.ddp else 'Single process'}",
        "",
        f"Command: `{command}`  ",
        f"Run: {machine_notes()}; {elapsed / 60:.1f} min, {launches} launches  ",
        f"Job: tests/support/train_script.py --every {cfg.every} --step-sleep {cfg.step_sleep} --width {cfg.width} "
        f"(seed {cfg.seed}, {cfg.n} trials per signal); code: git {git_revision(ROOT)} + {'the live working tree' if cfg.live else 'a snapshot of the working tree at the start'}",
        "",
        summary["table"],
        "",
    ]
    for v in summary["verdicts"]:
        lines.append(f"- {v['text']}: {'met' if v['met'] else 'MISSED'}")
    if summary["problems"]:
        lines += ["", "Problems:", ""]
        for p in summary["problems"]:
            lines.append(f"- trial {p['trial']} ({p['kind']}, during {p['hit']}): {'; '.join(p['problems'])}")
    return "\n".join(lines) + "\n"


def write_section(path: Path, label: str, body: str) -> None:
    start, end = f"<!-- fault-injection:{label} -->", f"<!-- /fault-injection:{label} -->"
    text = path.read_text() if path.exists() else _HEADER
    block = f"{start}\n{body}{end}\n"
    if start in text and end in text:
        pre, rest = text.split(start, 1)
        text = pre + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


_HEADER = """# Fault injection

`tests/support/fault_injection.py` SIGTERMs and SIGKILLs a real training job
(`tests/support/train_script.py`) at random moments — during steps, while a periodic save is in
flight ("flush"), and during start-up (after set-up, before the first step: restore,
strategy set-up, train start) — and restarts it like a scheduler until each restart
shows where it resumed. "hit during" is the phase observed when the signal was sent.
Steps lost = step at the signal (max over ranks) - step the restart resumed from,
floored at 0. "torn down": under DDP, ranks that outlived a SIGKILLed rank 0 were
SIGKILLed by the harness (what a scheduler does when a job step loses a task).
Expected exit codes: 143 on every rank after SIGTERM; -9 after SIGKILL of the launcher
(rank 0); after SIGKILL of rank 1 the launcher fails on the dead peer (gloo "connection
reset": 1) or is SIGKILLed by Lightning's child-process observer (-9): both accepted.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=30, help="trials per signal kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="sigterm,sigkill")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--ddp", action="store_true", help="2 ranks (gloo); the signal goes to a random rank")
    p.add_argument("--every", type=int, default=5, help="save interval in steps")
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--width", type=int, default=131072, help="model width: 10*width params + AdamW state")
    p.add_argument("--flush-delay", type=float, default=0.05, help="max random delay after a save starts")
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=180.0, help="per launch")
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    p.add_argument("--live", action="store_true", help="run the working tree, not a snapshot taken at the start")
    p.add_argument("--json", default=None, help="write the summary and every trial as JSON here")
    p.add_argument("--md", default=str(ROOT / "docs" / "fault-injection.md"), help="'' to skip")
    cfg = p.parse_args(argv)
    kinds = [k.strip().lower() for k in cfg.kinds.split(",") if k.strip()]
    phases = [ph.strip() for ph in cfg.phases.split(",") if ph.strip()]
    for k in kinds:
        if k not in EXPECTED_CODE:
            p.error(f"unknown kind {k!r}: use sigterm and/or sigkill")
    for ph in phases:
        if ph not in PHASES:
            p.error(f"unknown phase {ph!r}: use {', '.join(PHASES)}")

    rng = random.Random(cfg.seed)
    schedule = [
        Trial(0, kind, phases[i % len(phases)], rng.randrange(2) if cfg.ddp else 0)
        for kind in kinds
        for i in range(cfg.n)
    ]
    rng.shuffle(schedule)
    for i, t in enumerate(schedule):
        t.index = i
    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="lp-fault-"))
    work.mkdir(parents=True, exist_ok=True)
    if cfg.live:
        cfg.src, cfg.script = ROOT, SCRIPT
    else:
        cfg.src = snapshot(work)
        cfg.script = cfg.src / "train_script.py"
    runner = Runner(cfg, work)
    t0 = time.monotonic()
    try:
        trials = runner.run(schedule)
    finally:
        if cfg.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - t0
    summary = summarize(trials, cfg)
    command = "python tests/support/fault_injection.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = render(summary, cfg, command, elapsed, runner.launches)
    print()
    print(text)
    if cfg.md:
        write_section(Path(cfg.md), "ddp" if cfg.ddp else "single", text)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(summary | {"elapsed_s": elapsed, "launches": runner.launches}, indent=1))
    return 0 if all(v["met"] for v in summary["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
