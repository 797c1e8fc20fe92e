"""DDP at 3 real gloo ranks, without Lightning (lightning_preempt/resume/ddp_buckets.py):
K steps, a save, fresh processes, a load and K more steps end bitwise equal to 2K steps in
one run only when the resumed DDP starts with the bucket layout the saved run had rebuilt
(docs/exact-resume.md, "DDP's gradient buckets"). At 2 ranks ``a + b == b + a`` hides it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.multiproc

K = 3
WORLD = 3


def _worker(rank: int, world: int, out: str, start: int, steps: int, cap_mb: float | None, give: str) -> None:
    """``give``: "build" (DDP made with the layout: the Trainer's way), "rebuild" (given to a
    DDP already made: Fabric's way) or "" (DDP's own first buckets)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_preempt.resume import ddp_buckets

    torch.manual_seed(0)
    # Used in the opposite order to the parameters' (gradients come last layer first), and
    # large enough for several buckets with a small cap.
    net = torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Linear(96, 4))
    saved = torch.load(Path(out) / "saved.pt") if start else None
    if saved is not None:
        net.load_state_dict(saved["model"])
    layout = saved["layout"] if saved is not None and give else None
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    if give == "rebuild":
        ddp = DDP(net, **kwargs)
        assert ddp_buckets.rebuild(ddp, layout) == (layout is not None)
    else:
        ddp = ddp_buckets.build(lambda: DDP(net, **kwargs), layout)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    if saved is not None:
        opt.load_state_dict(saved["opt"])
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if rank == 0:
        state = {"model": net.state_dict(), "opt": opt.state_dict(), "layout": ddp_buckets.capture(ddp)}
        torch.save(state, Path(out) / ("saved.pt" if start == 0 and steps == K else f"end-{start}-{steps}.pt"))


def _weights(path: Path) -> dict[str, object]:
    import torch

    return torch.load(path)["model"]  # type: ignore[no-any-return]


def _resume(tmp_path: Path, cap_mb: float | None, give: str) -> tuple[dict[str, object], dict[str, object]]:
    """The weights after 2K steps in one run, and after K + K with a restart between."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    run_ranks(_worker, WORLD, tmp_path, str(ref), 0, 2 * K, cap_mb, give)
    run_ranks(_worker, WORLD, tmp_path, str(run), 0, K, cap_mb, give)
    run_ranks(_worker, WORLD, tmp_path, str(run), K, K, cap_mb, give)
    return _weights(ref / f"end-0-{2 * K}.pt"), _weights(run / f"end-{K}-{K}.pt")


@pytest.mark.parametrize(
    ("cap_mb", "give"),
    [
        (None, "build"),
        pytest.param(0.02, "build", marks=pytest.mark.slow),
        pytest.param(0.02, "rebuild", marks=pytest.mark.slow),
    ],
    ids=["default-buckets", "several-buckets", "several-buckets-given-after-construction"],
)
def test_a_resume_at_3_ranks_with_the_saved_bucket_layout_is_bit_identical(
    tmp_path: Path, cap_mb: float | None, give: str
) -> None:
    import torch

    reference, resumed = _resume(tmp_path, cap_mb, give)
    saved = torch.load(tmp_path / "run" / "saved.pt")
    layout = saved["layout"]
    assert layout is not None and sorted(i for b in layout["buckets"] for i in b) == list(range(6)), layout
    assert (len(layout["buckets"]) > 1) == (cap_mb is not None), layout  # the small cap splits the rebuilt buckets
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), name  # type: ignore[arg-type]


@pytest.mark.slow
def test_without_the_layout_the_resumed_run_differs_in_the_last_bits(tmp_path: Path) -> None:
    """Why the layout is saved: the same resume, DDP left to its own first buckets."""
    import torch

    reference, resumed = _resume(tmp_path, None, give="")
    differ = [n for n, t in reference.items() if not torch.equal(t, resumed[n])]  # type: ignore[arg-type]
    assert differ, "bit-identical without the layout: DDP's first buckets no longer differ from its rebuilt ones"
    assert all(torch.allclose(t, resumed[n], atol=1e-5) for n, t in reference.items())  # type: ignore[arg-type]
