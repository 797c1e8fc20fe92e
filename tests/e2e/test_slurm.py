"""Preemption under a real SLURM (22.05 on this machine: one node, or two in network
namespaces; tests/support/slurm.py).

Every test submits README's job script, ``examples/slurm/train.sbatch`` (which runs
``examples/slurm/train.py`` with ``srun``), to the ``low`` partition and lets SLURM interrupt
it: a ``high`` job preempts it by partition priority (``PreemptMode=REQUEUE``, GraceTime 20 s),
``scancel --signal=TERM`` / ``--signal=USR1``, or the time limit with the script's
``--signal=TERM@60``. Each asserts what a user sees: the job ends ``COMPLETED`` with the
expected ``Restarts``, every run resumed at the step the previous one snapshotted (0 steps
lost), the snapshot's "exiting with code 143" line is in the log before SLURM's
"CANCELLED ... DUE TO JOB REQUEUE", srun recorded "Exited with exit code 143" (not killed by a
signal), and the final weights are bitwise those of an uninterrupted run.

Without SLURM's programs these tests skip with how to install them (the ``slurm_cluster``
fixture). One preemption runs in every CI; the other scenarios are in the sampled slow set.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm import free_port

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "slurm"
MAX_STEPS = 60
EVERY = 20
#: SLURM's job states a job does not leave (squeue(1), "JOB STATE CODES"); not PREEMPTED, which a
#: job of a REQUEUE partition passes through on its way back to PENDING.
_END_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                         "DEADLINE"})  # fmt: skip
WAIT_S = 240.0  # the longest any one phase may take on a loaded 2-core machine (not asserted)


class Reference:
    """The final weights of the same script run uninterrupted, outside SLURM: started when the
    fixture is set up, read (waited for) when a test compares, so it runs beside the job."""

    def __init__(self, out: Path, devices: int = 1) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.path = out / "final.pt"
        self.proc = subprocess.Popen([sys.executable, str(EXAMPLE / "train.py"), "--dirpath", str(out / "ckpts"),
                                      "--weights", str(self.path), "--max-steps", str(MAX_STEPS), "--every",
                                      str(EVERY), "--devices", str(devices)], cwd=out, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self._weights: dict[str, torch.Tensor] | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            out, _ = self.proc.communicate(timeout=WAIT_S)
            assert self.proc.returncode == 0, out
            self._weights = torch.load(self.path)
        return self._weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import slurm

    if slurm.missing():
        pytest.skip(slurm.HOW_TO_GET)  # (the slurm_cluster fixture says the same)
    ref = Reference(tmp_path_factory.mktemp("uninterrupted"))
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


class Job:
    """A submitted ``train.sbatch`` and its log (every run appends: ``--open-mode=append``)."""

    def __init__(self, cluster, tmp_path: Path, *options: str, step_sleep: float, script: tuple[str, ...] = (),
                 args: tuple[str, ...] = ()) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
        self.cluster = cluster
        self.log = tmp_path / "job.out"
        self.weights = tmp_path / "final.pt"
        env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            # A fresh port for the job's store: sbatch exports this process's environment, where an
            # earlier in-process test may have left a MASTER_PORT that is in use now (EADDRINUSE in
            # CI), and every test cluster numbers its jobs from 1 (Lightning's default port).
            "MASTER_PORT": str(free_port()),
        }
        train_args = ["--dirpath", str(tmp_path / "ckpts"), "--weights", str(self.weights), "--max-steps",
                      str(MAX_STEPS), "--every", str(EVERY), "--step-sleep", str(step_sleep), *args]  # fmt: skip
        # README's job script, or (``script``) a command line of its own run by --wrap
        what = ["--wrap", " ".join([*script, *train_args])] if script else [str(EXAMPLE / "train.sbatch"), *train_args]
        self.id = cluster.sbatch("--partition=low", f"--chdir={EXAMPLE}", f"--output={self.log}", "--requeue",
                                 "--open-mode=append", *options, *what, env=env)  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def runs(self) -> list[list[int]]:
        """Per run of the job: its start step, then every step it printed."""
        out: list[list[int]] = []
        for line in self.text().splitlines():
            if m := re.fullmatch(r"start step (\d+)", line):
                out.append([int(m[1])])
            elif (m := re.fullmatch(r"step (\d+)", line)) and out:
                out[-1].append(int(m[1]))
        return out

    def wait_step(self, run: int, steps: int) -> None:
        """Until run number ``run`` (0-based) has trained ``steps`` steps since its start."""
        deadline = time.monotonic() + WAIT_S
        while True:
            runs = self.runs()
            if len(runs) > run and runs[run][-1] >= runs[run][0] + steps:
                return
            state = self.cluster.job(self.id).get("JobState")
            if state in _END_STATES:
                raise AssertionError(f"job {self.id} ended ({state}) before run {run} reached +{steps} steps:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run} of job {self.id} did not reach +{steps} steps:\n{self.text()}")
            time.sleep(0.2)

    def wait_text(self, text: str) -> None:
        """Until the job's log holds ``text``."""
        deadline = time.monotonic() + WAIT_S
        while text not in self.text():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}'s log never showed {text!r}:\n{self.text()}")
            time.sleep(0.2)

    def final(self) -> dict[str, str]:
        # Wait for an end state: transient ones are many (SIGNALING while a preemption's
        # signal is delivered, REQUEUED, COMPLETING, CONFIGURING…) and a poll can land on any.
        return self.cluster.wait_job(self.id, lambda f: f.get("JobState") in _END_STATES, WAIT_S * 2, "its end")

    def preempt_by_high_job(self) -> str:
        """Submit a ``high`` job that needs the node: SLURM preempts this one to run it."""
        return self.cluster.sbatch("--partition=high", "--output=/dev/null", "--wrap", "sleep 1")


def assert_resumed_exactly(job: Job, reference: Reference, *, restarts: int) -> None:
    """The job's end as SLURM and its log record it; see the module docstring."""
    fields = job.final()
    text = job.text()
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{text}"
    assert int(fields["Restarts"]) == restarts, f"{fields}\n{text}"
    runs = job.runs()
    assert len(runs) == restarts + 1, text
    for before, after in itertools.pairwise(runs):
        assert before[-1] - after[0] == 0, f"steps lost: trained {before[-1]}, resumed at {after[0]}\n{text}"
    assert runs[-1][-1] == MAX_STEPS
    # Every interrupted run: its snapshot committed and its exit line was written before
    # SLURM's kill, and srun saw the process exit 143 by itself.
    segments = re.split(r"(?m)^start step \d+$", text)[1:]
    for segment in segments[:-1]:
        exiting = segment.find("exiting with code 143; safe to resume from: step")
        killed = segment.find("DUE TO JOB REQUEUE")
        assert 0 <= exiting < killed, f"the exit line must precede SLURM's kill:\n{segment}"
    assert text.count("task 0: Exited with exit code 143") == restarts, text
    assert "task 0: Terminated" not in text and "task 0: Killed" not in text, text
    records = job.cluster.records(job.id)
    assert records[-1]["JobState"] == "COMPLETED", records
    assert records[-1]["DerivedExitCode"] == ("143:0" if restarts else "0:0"), records  # the steps' worst exit
    final, expected = torch.load(job.weights), reference.weights()
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"


def _preempted(slurm_cluster, tmp_path: Path, reference: Reference, times: int) -> None:  # type: ignore[no-untyped-def]
    job = Job(slurm_cluster, tmp_path, step_sleep=0.1)
    for run in range(times):
        job.wait_step(run, 8)
        job.preempt_by_high_job()
    assert_resumed_exactly(job, reference, restarts=times)


def test_preempted_by_a_high_partition_job_resumes_exactly(slurm_cluster, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """CI's SLURM test: partition-priority preemption, once."""
    _preempted(slurm_cluster, tmp_path, reference, times=1)


@pytest.mark.slow
def test_preempted_twice_in_one_run(slurm_cluster, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    _preempted(slurm_cluster, tmp_path, reference, times=2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["TERM", "USR1"])
def test_scancel_signal(slurm_cluster, tmp_path: Path, reference, sig: str) -> None:  # type: ignore[no-untyped-def]
    """``scancel --signal=TERM`` and the SIGUSR1 early warning (what ``--signal=USR1@T`` sends
    to the job step): the script listens to both (``signals=("SIGUSR1", "SIGTERM")``)."""
    job = Job(slurm_cluster, tmp_path, step_sleep=0.1)
    job.wait_step(0, 8)
    slurm_cluster.run("scancel", f"--signal={sig}", job.id)
    assert_resumed_exactly(job, reference, restarts=1)
    assert f"snapshot taken after SIG{sig}: 0 steps lost" in job.text()


@pytest.mark.slow
def test_time_limit_with_the_early_signal_snapshots_and_requeues_before_it(slurm_cluster, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """``--time=2`` with the script's ``--signal=TERM@60``: SLURM signals the job step 60-90 s
    before the limit (its check runs every 30 s); the run snapshots and requeues itself, so it
    never reaches the limit (no TIMEOUT). The operator then gives the requeued job 10 minutes,
    so the second run ends with training (a run whose training ends just as the early signal
    comes is killed in its exit: see the module docstring of examples/slurm/train.py)."""
    job = Job(slurm_cluster, tmp_path, "--time=2", step_sleep=1.2)  # 72 s of training: past the signal
    slurm_cluster.wait_job(job.id, lambda f: f.get("Restarts") == "1", WAIT_S, "the requeue before the limit")
    slurm_cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    assert_resumed_exactly(job, reference, restarts=1)
    assert "DUE TO TIME LIMIT" not in job.text()


@pytest.mark.slow
def test_under_the_torchrun_wrapper_the_reclaimed_nodes_agent_requeues(slurm_cluster, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """docs/elastic.md's SLURM recipe (one job per node, ``lightning_preempt.torchrun``): the
    workers do not requeue (their rank 0 may be on another node); the agent that received
    SLURM's SIGTERM requeues its own job after its workers' snapshot, as its last act."""
    launch = ("srun", sys.executable, "-m", "lightning_preempt.torchrun", "--standalone", "--nproc-per-node=1",
              "train.py")  # fmt: skip
    job = Job(slurm_cluster, tmp_path, step_sleep=0.1, script=launch)
    job.wait_step(0, 8)
    job.preempt_by_high_job()
    assert_resumed_exactly(job, reference, restarts=1)
    text = job.text()
    assert "the agent received SIGTERM; exiting with 143; requeueing SLURM job" in text, text
    assert "requeueing SLURM job" not in text.split("the agent received")[0], "a worker requeued"


@pytest.mark.slow
def test_scancel_ends_the_job_for_good(slurm_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A plain ``scancel``: SLURM sends SIGTERM and marks the job CANCELLED; the snapshot is
    taken, but a cancelled job is not requeued (SLURM would requeue it: it did before)."""
    job = Job(slurm_cluster, tmp_path, step_sleep=0.1)
    job.wait_step(0, 8)
    slurm_cluster.run("scancel", job.id)
    job.final()
    # The run logs this in place of its requeue, as its last act: once it is there, no requeue follows.
    job.wait_text(f"SLURM job {job.id} is COMPLETING before its time limit (scancel;")
    fields = slurm_cluster.job(job.id)
    text = job.text()
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", f"{fields}\n{text}"
    assert f"SLURM job {job.id} is COMPLETING before its time limit (scancel;" in text, text
    assert f"not requeueing it (`scontrol requeue {job.id}` brings it back)" in text, text
    assert len(job.runs()) == 1


@pytest.mark.slow
def test_requeue_false_is_lost_on_preemption_and_says_so(slurm_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What ``requeue=False`` costs under SLURM, measured: the job exits 143 inside GraceTime
    and SLURM records it FAILED without requeueing it, even with PreemptMode=REQUEUE and
    ``--requeue``. The callback says so (with a HINT) when the job starts."""
    job = Job(slurm_cluster, tmp_path, step_sleep=0.1, args=("--no-requeue",))
    job.wait_step(0, 8)
    job.preempt_by_high_job()
    fields = job.final()
    text = job.text()
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", f"{fields}\n{text}"
    assert fields["ExitCode"] == "143:0", fields
    assert "requeue=False under SLURM" in text and "HINT: leave requeue=None" in text, text


@pytest.mark.slow
def test_two_tasks_every_rank_absorbs_slurms_sigterm_after_the_requeue(slurm_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 32: ``--ntasks=2`` (DDP over gloo, one node): rank 0 requeues, SLURM's SIGTERM then
    reaches both tasks; both exit 143 by themselves, the job is REQUEUED (not FAILED), ends
    COMPLETED and its weights are bitwise those of an uninterrupted 2-process run."""
    reference = Reference(tmp_path / "ref", devices=2) if (tmp_path / "ref").mkdir() is None else None
    assert reference is not None
    job = Job(slurm_cluster, tmp_path, "--ntasks-per-node=2", "--overcommit", "--export=ALL,MASTER_ADDR=127.0.0.1",
              step_sleep=0.1, args=("--devices", "2"))  # fmt: skip
    job.wait_step(0, 8)
    job.preempt_by_high_job()
    fields = job.final()
    text = job.text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{text}"
    # srun: both tasks exited 143 by themselves, on one line ("tasks 0-1") or two, as they happen to end
    assert "tasks 0-1: Exited with exit code 143" in text or "task 1: Exited with exit code 143" in text, text
    assert "Terminated" not in text and "Killed" not in text, text
    final, expected = torch.load(job.weights), reference.weights()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"


@pytest.fixture
def two_node_cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two slurmd nodes, each in a network namespace of its own (tests/support/netns.py):
    slurmctld on the first, one CPU each; skips where SLURM or namespaces are missing."""
    import netns
    import slurm

    absent = slurm.missing()
    if absent:
        pytest.skip(f"{', '.join(absent)} not found. {slurm.HOW_TO_GET}")
    if netns.missing():
        pytest.skip(str(netns.missing()))
    with netns.Hosts(2) as hosts, slurm.cluster(tmp_path / "slurm", hosts=hosts) as cluster:
        yield cluster


@pytest.mark.slow
def test_two_nodes_every_rank_absorbs_slurms_sigterm_after_the_requeue(two_node_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 32: ``--nodes=2`` (one task each, DDP over gloo between two slurmd nodes): rank 0
    requeues, SLURM's SIGTERM reaches the task on each node; both exit 143 by themselves, the
    job is REQUEUED (not FAILED), both tasks resume at the snapshot's step, and the final
    weights are bitwise those of an uninterrupted 2-process run."""
    reference = Reference(tmp_path / "ref", devices=2) if (tmp_path / "ref").mkdir() is None else None
    assert reference is not None
    job = Job(two_node_cluster, tmp_path, "--nodes=2", "--ntasks-per-node=1", step_sleep=0.1,
              args=("--num-nodes", "2"))  # fmt: skip
    job.wait_step(0, 8)
    job.preempt_by_high_job()
    fields = job.final()
    text = job.text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{text}"
    assert "lp1: task 0: Exited with exit code 143" in text and "lp2: task 1: Exited with exit code 143" in text, text
    assert "Terminated" not in text and "Killed" not in text, text
    records = two_node_cluster.records(job.id)
    # one line per run: the preempted one went back to PENDING (requeued, not FAILED), both on both nodes
    assert [(r["JobState"], r["NodeList"]) for r in records] == [("PENDING", "lp[1-2]"), ("COMPLETED", "lp[1-2]")], records
    runs = job.runs()
    assert len(runs) == 2 and runs[0][-1] == runs[1][0], f"steps lost: {runs}\n{text}"
    assert text.count(f"resuming from {tmp_path / 'ckpts'}/step-") == 2, text  # both ranks resumed
    final, expected = torch.load(job.weights), reference.weights()
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
