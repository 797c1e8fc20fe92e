"""Exact resume: preempted-and-restarted runs end bitwise equal to an uninterrupted run.

Real processes (``tests/support/exact_script.py``, forked from the zygote: support/jobs.py): the job is signalled at chosen steps, exits
with 143 (SIGTERM) or is killed (SIGKILL), and is restarted with the same command; the
callback resumes it from the newest checkpoint each time. We compare the final weights
bitwise, the sequence of sample indices trained per step, and the epoch metrics.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "exact_script.py"
PREEMPTED = 143


# ---- harness -----------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_for_pid(path: Path, proc: Any, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _read_int(path)
        if pid is not None:
            return pid
        if proc.poll() is not None:
            raise AssertionError(f"job exited with {proc.returncode} before writing {path.name}")
        time.sleep(0.02)
    raise AssertionError(f"no {path.name} after {timeout}s")


def run_job(
    args: list[str],
    status: Path,
    *,
    preempt_at: list[int] = (),  # type: ignore[assignment]
    sig: signal.Signals = signal.SIGTERM,
    signal_rank: int = 0,
    timeout: float = 120.0,
    finish: bool = True,
) -> list[int]:
    """Run the script, signal ``signal_rank`` once its step reaches each of ``preempt_at``
    (restarting after each), then (``finish``) let the last start finish. Returns the exit codes."""
    codes: list[int] = []
    for target in [*preempt_at, None] if finish else list(preempt_at):
        for f in status.glob("rank*.step"):
            f.unlink()
        for f in status.glob("rank*.pid"):
            f.unlink()
        proc = launch(SCRIPT, ROOT, "--status", str(status), *args, env=_env())
        try:
            if target is not None:
                pid = _wait_for_pid(status / f"rank{signal_rank}.pid", proc, timeout)
                deadline = time.monotonic() + timeout
                while (_read_int(status / f"rank{signal_rank}.step") or 0) < target:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        out = proc.communicate(timeout=timeout)[0] if proc.poll() is not None else ""
                        raise AssertionError(f"job ended (rc={proc.returncode}) before step {target}:\n{out[-3000:]}")
                    time.sleep(0.005)
                os.kill(pid, sig)
            out, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        codes.append(proc.returncode)
        expected = 0 if target is None else (PREEMPTED if sig == signal.SIGTERM else None)
        if expected is not None and proc.returncode != expected:
            raise AssertionError(f"exit code {proc.returncode}, expected {expected}:\n{out[-4000:]}")
    return codes


def batches(status: Path, rank: int = 0) -> list[dict[str, Any]]:
    lines = (status / f"rank{rank}.batches.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def dedup(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Records in training order with replays (after SIGKILL) removed; replays must match."""
    seen: dict[tuple[int, int, int], dict[str, Any]] = {}
    order: list[tuple[int, int, int]] = []
    replays = 0
    for rec in records:
        key = (rec["step"], rec["epoch"], rec["batch_idx"])
        if key in seen:
            assert seen[key] == rec, f"replayed batch differs: {seen[key]} != {rec}"
            replays += 1
            continue
        seen[key] = rec
        order.append(key)
    return [seen[k] for k in order], replays


def assert_same_weights(a: Path, b: Path) -> None:
    wa = torch.load(a, weights_only=True)
    wb = torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ in {different}"


def result(status: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((status / f"rank{rank}.result.json").read_text())


# ---- fixtures ----------------------------------------------------------------------------
COMMON = ["--max-steps", "30", "--n", "80", "--batch-size", "8", "--step-sleep", "0.03"]
"""10 batches per epoch, 3 epochs: preemptions land mid-epoch and on epoch ends."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of the single-process job (shared by the tests below)."""
    base = tmp_path_factory.mktemp("exact-ref")
    run_job([*COMMON, "--dirpath", str(base / "ckpt")], base / "status")
    return base / "status"


def compare(reference: Path, status: Path, rank: int = 0, *, expect_replays: bool = False) -> None:
    ref, _ = dedup(batches(reference, rank))
    got, replays = dedup(batches(status, rank))
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    assert got == ref, "the resumed runs trained different samples"
    if not expect_replays:
        assert replays == 0, "a SIGTERM snapshot should not lose (and replay) any batch"
    assert_same_weights(reference / f"rank{rank}.weights.pt", status / f"rank{rank}.weights.pt")
    r_ref, r_got = result(reference, rank), result(status, rank)
    assert r_got["step"] == r_ref["step"]
    assert r_got["lr"] == r_ref["lr"]
    assert r_got["epoch_metrics"] == r_ref["epoch_metrics"]


# ---- tests -------------------------------------------------------------------------------
@pytest.mark.slow  # three preemptions; test_preemption.py's single SIGTERM stays in every run
@pytest.mark.multiproc
def test_sigterm_three_times_single_process(reference: Path, tmp_path: Path) -> None:
    # 7: mid-epoch; 10: the last batch of epoch 0 (the save ends the epoch); 23: mid-epoch 2.
    codes = run_job([*COMMON, "--dirpath", str(tmp_path / "ckpt")], tmp_path / "status", preempt_at=[7, 9, 23])
    assert codes == [PREEMPTED, PREEMPTED, PREEMPTED, 0]
    compare(reference, tmp_path / "status")
    assert result(tmp_path / "status")["exact"] in ("mid-epoch", "epoch-end")


@pytest.mark.multiproc
def test_sigkill_with_periodic_saves_repeats_only_lost_steps(reference: Path, tmp_path: Path) -> None:
    status = tmp_path / "status"
    codes = run_job(
        [*COMMON, "--every", "4", "--dirpath", str(tmp_path / "ckpt")],
        status,
        preempt_at=[9, 19],
        sig=signal.SIGKILL,
    )
    assert codes[:2] == [-signal.SIGKILL, -signal.SIGKILL]
    compare(reference, status, expect_replays=True)
    # Each restart repeated exactly the steps after the newest checkpoint (a multiple of 4).
    steps = [r["step"] for r in batches(status)]
    restarts = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(restarts) == 2
    for i in restarts:
        assert steps[i] % 4 == 0 and steps[i] < steps[i - 1] + 1


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("variant", ["accumulate", "stateful", "many", "amp", "workers"])
def test_exact_resume_variants(tmp_path: Path, variant: str) -> None:
    """Gradient accumulation (saves only at optimizer steps), torchdata StatefulDataLoader
    (Lightning saves its position; we must not wrap it), many preemptions incl. right
    after a restart and on epoch ends, 16-mixed AMP whose GradScaler state changes, and
    worker processes (their iterators prefetch indices as soon as they are created)."""
    extra = {
        "accumulate": ["--accumulate", "3", "--max-steps", "12"],
        "stateful": ["--stateful"],
        "many": [],
        "amp": ["--amp"],
        "workers": ["--workers", "2"],
    }[variant]
    preempt = {
        "accumulate": [2, 4, 7],
        "stateful": [4, 9, 17],
        "many": [1, 2, 5, 9, 13, 19, 26],
        "amp": [4, 9, 17],
        "workers": [7, 9, 23],
    }[variant]
    args = [*COMMON, *extra]
    run_job([*args, "--dirpath", str(tmp_path / "ref-ckpt")], tmp_path / "ref")
    run_job([*args, "--dirpath", str(tmp_path / "ckpt")], tmp_path / "status", preempt_at=preempt)
    compare(tmp_path / "ref", tmp_path / "status")
    if variant == "amp":
        assert result(tmp_path / "status")["scale"] == result(tmp_path / "ref")["scale"] != 2.0**14


@pytest.mark.slow
@pytest.mark.multiproc
def test_world_size_change_seeds_new_ranks_from_rank0(tmp_path: Path) -> None:
    """Saved by 1 rank, resumed by 2: rank 1 has no saved RNG state and gets a derived seed."""
    status, ckpt = tmp_path / "status", str(tmp_path / "ckpt")
    run_job([*COMMON, "--dirpath", ckpt], status, preempt_at=[5], timeout=180, finish=False)
    (status / "rank0.batches.jsonl").unlink()
    run_job([*COMMON, "--dirpath", ckpt, "--devices", "2", "--strategy", "ddp"], status, timeout=180)
    runs = [json.loads(x) for x in (status / "rank1.runs.jsonl").read_text().splitlines()]
    assert runs[-1]["exact"] == "derived"
    # Rank 0 restores its own state (2 ranks halve the epoch: step 6 is past its end now).
    assert json.loads((status / "rank0.runs.jsonl").read_text().splitlines()[-1])["exact"] in ("mid-epoch", "epoch-end")
    assert_same_weights(status / "rank0.weights.pt", status / "rank1.weights.pt")  # DDP keeps them in sync
    first0, first1 = batches(status, 0)[0], batches(status, 1)[0]
    assert first0["step"] == first1["step"] > 0 and first0["idx"] != first1["idx"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("signal_rank", [1, 0])
def test_sigterm_ddp_two_ranks(tmp_path: Path, signal_rank: int) -> None:
    args = [*COMMON, "--devices", "2", "--strategy", "ddp", "--max-steps", "16"]
    run_job([*args, "--dirpath", str(tmp_path / "ref-ckpt")], tmp_path / "ref", timeout=180)
    codes = run_job(
        [*args, "--dirpath", str(tmp_path / "ckpt")],
        tmp_path / "status",
        preempt_at=[3, 5, 11],
        signal_rank=signal_rank,
        timeout=180,
    )
    assert codes == [PREEMPTED, PREEMPTED, PREEMPTED, 0]
    for rank in (0, 1):
        compare(tmp_path / "ref", tmp_path / "status", rank)
    # Both ranks trained different samples (DistributedSampler), every step.
    assert batches(tmp_path / "status", 0)[0]["idx"] != batches(tmp_path / "status", 1)[0]["idx"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_sigterm_ddp_three_ranks(tmp_path: Path) -> None:
    """At 3 ranks gloo's sums depend on where a gradient sits in DDP's bucket: the resumed
    DDP starts in the layout the saved run had rebuilt (docs/exact-resume.md, "DDP's
    gradient buckets"); without it the weights differ in the last bits."""
    args = [*COMMON, "--devices", "3", "--strategy", "ddp", "--max-steps", "12"]
    run_job([*args, "--dirpath", str(tmp_path / "ref-ckpt")], tmp_path / "ref", timeout=300)
    codes = run_job([*args, "--dirpath", str(tmp_path / "ckpt")], tmp_path / "status", preempt_at=[5],
                    signal_rank=2, timeout=300)  # fmt: skip
    assert codes == [PREEMPTED, 0]
    for rank in range(3):
        compare(tmp_path / "ref", tmp_path / "status", rank)


# ---- in-process unit tests of the mechanism ----------------------------------------------
def _draw_epochs(loader: Any, epochs: int) -> list[list[int]]:
    out = []
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        out.append([int(i) for b in loader for i in b[0].tolist()])
        torch.rand(3)  # training between epochs moves the global RNG
    return out


@pytest.mark.parametrize("kind", ["random", "random-generator", "random-replacement", "sequential", "distributed"])
def test_resumable_sampler_yields_what_the_original_yields(kind: str) -> None:
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

    from lightning_preempt.resume.samplers import ResumableSampler, wrap_loader

    data = TensorDataset(torch.arange(50))

    def make() -> DataLoader[Any]:
        if kind == "random":
            return DataLoader(data, batch_size=4, shuffle=True)
        if kind == "random-generator":
            return DataLoader(
                data, batch_size=4, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(3))
            )
        if kind == "random-replacement":
            return DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, num_samples=70))
        if kind == "sequential":
            return DataLoader(data, batch_size=4)
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=5))

    torch.manual_seed(0)
    plain = _draw_epochs(make(), 3)
    rng_after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    loader = make()
    kind_found, sampler = wrap_loader(loader)
    assert kind_found == "sampler" and isinstance(sampler, ResumableSampler)
    assert _draw_epochs(loader, 3) == plain
    assert torch.equal(torch.get_rng_state(), rng_after_plain), "the wrapper must draw exactly what the original draws"

    # Resume epoch 1 after 5 batches in a "new process": same rest of the epoch, no extra draw.
    torch.manual_seed(0)
    loader = make()
    _, sampler = wrap_loader(loader)
    assert sampler is not None
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(0)
    list(loader)
    saved_state = sampler.epoch_state
    fresh = make()
    _, resumed = wrap_loader(fresh)
    assert resumed is not None
    if hasattr(fresh.sampler, "set_epoch"):
        fresh.sampler.set_epoch(0)
    resumed.resume_at(saved_state, 5 * 4)
    before = torch.get_rng_state()
    rest = list(resumed)  # the sampler alone: iter(DataLoader) itself draws a worker base seed
    assert rest == plain[0][20:]
    assert torch.equal(torch.get_rng_state(), before), "a resumed epoch must not draw its seed again"


def test_unsupported_loader_is_reported_not_wrapped() -> None:
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    from lightning_preempt.resume.samplers import wrap_loader

    data = TensorDataset(torch.arange(10))

    class MyBatchSampler(BatchSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from super().__iter__()

    loader = DataLoader(data, batch_sampler=MyBatchSampler(SequentialSampler(data), 2, False))
    assert wrap_loader(loader) == ("unsupported", None)


def test_rng_capture_restore_and_derived_seeds() -> None:
    import random

    import numpy as np

    from lightning_preempt.resume.exact_state import capture_rng, derive_seed, restore_rng

    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    state = capture_rng()
    a = (torch.rand(2), random.random(), np.random.rand())
    restore_rng(state)
    b = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert derive_seed(state, 1) != derive_seed(state, 2)
    assert derive_seed(state, 1) == derive_seed(dict(state), 1)
