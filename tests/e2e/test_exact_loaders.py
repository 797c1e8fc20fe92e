"""Exact resume for every kind of training loader (issue 12, point 8).

Each case runs ``tests/exact_script.py`` once uninterrupted and once preempted several
times (``--sigterm-at``: a real SIGTERM while that step trains, so the snapshot holds
exactly that many steps) and restarted after each, 4 epochs of 10 batches. We compare the
trained sample indices and inputs per step, the final weights bitwise and the epoch metrics.

The snapshots land one batch before an epoch boundary (9), at it (10: the save ends the
epoch) and one batch after it (11), then mid-epoch with the next boundaries crossed by the
resumed process (25 -> 30 -> 40): a state restored wrongly shows in the epochs after it.

``--aug`` adds noise drawn in ``__getitem__``: in worker processes that noise depends on the
workers' base seed and on how many samples they loaded before, so it is exact only with
``--replay`` (``exact.replay_worker_draws``: the workers load the trained batches again).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from jobs import launch
from test_exact_resume import COMMON, PREEMPTED, ROOT, SCRIPT, _env, compare

EPOCHS4 = [*COMMON, "--max-steps", "40"]  # 10 batches per epoch
AT_BOUNDARIES = "9,10,11,25"
# DistributedSampler(num_replicas=2): 5 batches per epoch, 8 epochs.
AT_BOUNDARIES_5 = "4,5,6,13"

# name -> extra flags
CASES: dict[str, list[str]] = {
    "loader-generator": ["--generator", "5"],
    # Worker-side draws (--aug) are exact only when the workers replay the trained batches.
    "loader-generator-workers-replay": ["--generator", "5", "--workers", "2", "--aug", "--replay"],
    "workers-aug-replay": ["--workers", "2", "--aug", "--replay"],
    "stateful": ["--stateful"],
    "stateful-generator": ["--stateful", "--generator", "5"],
    "stateful-generator-workers": ["--stateful", "--generator", "5", "--workers", "2"],
    "distributed-set-epoch": ["--sampler", "distributed"],
    "stateful-distributed-set-epoch": ["--stateful", "--sampler", "distributed"],
    # 2 ranks: Lightning wraps each loader's sampler in a DistributedSamplerWrapper (5 batches per epoch).
    # Lightning's DistributedSamplerWrapper draws the permutation each time it is iterated,
    # and torchdata iterates it up to three times to resume it (exact.rewound_sampler).
    "ddp-stateful-generator": ["--stateful", "--generator", "5", "--devices", "2", "--strategy", "ddp"],
    # ... and without a loader generator: the wrapped RandomSampler's own generator shuffles.
    "ddp-stateful": ["--stateful", "--devices", "2", "--strategy", "ddp"],
    # reload_dataloaders_every_n_epochs=1: each epoch trains a new loader object.
    "reload": ["--reload"],
    "reload-workers-replay": ["--reload", "--workers", "2", "--aug", "--replay"],
    "reload-stateful": ["--reload", "--stateful"],
}
FAST = {"stateful-generator"}  # the reproducer runs in the default suite; the rest are `slow`


def run_until_done(
    args: list[str], status: Path, max_starts: int, timeout: float = 180.0, outputs: list[str] | None = None
) -> list[int]:
    """Start the job until it exits 0 (each start resumes); returns the exit codes (and
    appends each start's output to ``outputs``)."""
    codes: list[int] = []
    for _ in range(max_starts):
        proc = launch(SCRIPT, ROOT, "--status", str(status), *args, env=_env())
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        codes.append(proc.returncode)
        if outputs is not None:
            outputs.append(out)
        if proc.returncode == 0:
            return codes
        assert proc.returncode == PREEMPTED, f"exit code {proc.returncode}:\n{out[-4000:]}"
    raise AssertionError(f"not done after {max_starts} starts: {codes}")


def _runs(status: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (status / "rank0.runs.jsonl").read_text().splitlines()]


def _run_case(tmp_path: Path, name: str) -> None:
    extra = CASES[name]
    five = "distributed" in name or "ddp" in name  # batches per epoch: 5, else 10
    at = AT_BOUNDARIES_5 if five else AT_BOUNDARIES
    args = [*EPOCHS4, *extra]
    run_until_done([*args, "--dirpath", str(tmp_path / "ref-ckpt")], tmp_path / "ref", max_starts=1)
    status = tmp_path / "status"
    outputs: list[str] = []
    codes = run_until_done(
        [*args, "--dirpath", str(tmp_path / "ckpt"), "--sigterm-at", at], status, max_starts=8, outputs=outputs
    )
    steps = [int(n) for n in at.split(",")]
    runs = _runs(status)
    if "ddp" in name:
        # Ranks agree on the signal overlapped with the next step: the snapshot lands one
        # step later, and a signal during a step that is no longer trained never comes.
        assert codes[-1] == 0 and set(codes[:-1]) == {PREEMPTED}, codes
        assert {"mid-epoch", "epoch-end"} <= {r["exact"] for r in runs[1:]}
    else:
        assert codes == [PREEMPTED] * len(steps) + [0]
        assert [r["end_step"] for r in runs] == [*steps, 40], "each snapshot holds exactly the steps asked for"
        per_epoch = 5 if five else 10
        expected = ["mid-epoch" if n % per_epoch else "epoch-end" for n in steps]
        assert [r["exact"] for r in runs[1:]] == expected
    for rank in range(2 if "ddp" in name else 1):
        compare(tmp_path / "ref", status, rank)
    # Worker loaders resumed mid-epoch without replay are told that draws inside the workers
    # are not replayed; with replay (or without workers) nothing is said.
    warned = ["resuming mid-epoch with worker processes" in out for out in outputs]
    assert any(warned) == ("--workers" in extra and "--replay" not in extra), warned


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(FAST))
def test_exact_resume_loader_fast(tmp_path: Path, name: str) -> None:
    _run_case(tmp_path, name)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(set(CASES) - FAST))
def test_exact_resume_loader(tmp_path: Path, name: str) -> None:
    _run_case(tmp_path, name)


def test_iterable_dataset_warns_that_its_position_is_not_resumed(tmp_path: Path) -> None:
    """An IterableDataset has no sampler to resume: the user is told, with what to do."""
    import lightning as L
    from exact_script import DropoutModel, Stream, dataset
    from torch.utils.data import DataLoader

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=[PreemptionCallback(str(tmp_path / "ckpt"))],
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DropoutModel(), DataLoader(Stream(dataset(16)), batch_size=4))
    texts = [str(w.message) for w in caught]
    assert any("cannot resume the position of the training data" in t and "HINT:" in t for t in texts), texts
    assert trainer.global_step == 2



def test_loader_generators_are_found_for_every_loader_kind() -> None:
    """The generators whose states decide the data order (loader's, sampler's) are captured."""
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_preempt.resume.samplers import loader_generators

    data = TensorDataset(torch.arange(8))
    g, h = torch.Generator(), torch.Generator()
    assert loader_generators(DataLoader(data, shuffle=True)) == []
    assert loader_generators(DataLoader(data, shuffle=True, generator=g)) == [g]
    assert loader_generators(DataLoader(data, sampler=RandomSampler(data, generator=h), generator=g)) == [g, h]
    stateful = loader_generators(StatefulDataLoader(data, shuffle=True))
    assert len(stateful) == 1, "torchdata's RandomSampler owns a generator even without one given"
    assert loader_generators(StatefulDataLoader(data, shuffle=True, generator=g)) == [g]


def test_loader_generators_look_inside_lightnings_distributed_sampler_wrapper() -> None:
    """Under DDP the shuffling generator is the wrapped sampler's (torchdata's RandomSampler)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    from lightning_preempt.resume.samplers import loader_generators

    data = TensorDataset(torch.arange(8))
    own = StatefulRandomSampler(data)  # no generator given: it makes one
    wrapped = DistributedSamplerWrapper(own, num_replicas=2, rank=0)
    assert loader_generators(StatefulDataLoader(data, sampler=wrapped)) == [own.generator]
    g = torch.Generator()
    shared = DistributedSamplerWrapper(StatefulRandomSampler(data, generator=g), num_replicas=2, rank=0)
    assert loader_generators(StatefulDataLoader(data, sampler=shared, generator=g)) == [g], "each generator once"


class _EagerSampler(torch.utils.data.Sampler[int]):
    """Draws its permutation when iterated (like Lightning's DistributedSamplerWrapper)."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


class _LazySampler(_EagerSampler):
    """Draws at the first index (a generator function, like torch's RandomSampler)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from torch.randperm(self.n, generator=self.generator).tolist()


@pytest.mark.parametrize("cls", [_EagerSampler, _LazySampler])
def test_rewound_sampler_repeats_the_epoch_start_draw_however_often_torchdata_iterates(cls: type) -> None:
    """torchdata iterates a sampler without state_dict several times to resume it; the
    permutation it keeps must be the one drawn from the states the epoch began with, and the
    draws made between the iterations (the loader's worker base seed) must stay."""
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_preempt.resume.samplers import rewound_sampler, snapshot_iter_rng

    g = torch.Generator().manual_seed(7)
    loader = StatefulDataLoader(TensorDataset(torch.arange(16)), sampler=cls(16, g), batch_size=4, generator=g)
    pre_iter = snapshot_iter_rng([g])
    epoch = [b[0].tolist() for b in loader]  # the uninterrupted epoch, from pre_iter
    after_epoch = g.get_state()

    it = iter(loader)
    next(it)
    position = loader.state_dict()  # one batch trained
    g.set_state(pre_iter["generators"][0])
    loader.load_state_dict(position)
    with rewound_sampler(loader, pre_iter):
        resumed = iter(loader)  # torchdata: iter(sampler), then twice more to skip the trained batch
    assert [b[0].tolist() for b in resumed] == epoch[1:]
    assert torch.equal(g.get_state(), after_epoch), "the generator ends the epoch where it did uninterrupted"
    assert isinstance(loader.batch_sampler.sampler, cls), "the original sampler is put back"

