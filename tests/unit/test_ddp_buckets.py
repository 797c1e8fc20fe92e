"""The saved DDP bucket layout, in one process (resume/ddp_buckets.py; with real ranks:
tests/multiproc/test_ddp_buckets_multirank.py)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from lightning_preempt.resume import ddp_buckets

# Three parameters of 4, 2 and 3 float32s; the rebuilt layout reduces 2 and 1 first, then 0.
PARAMS = [torch.zeros(4), torch.zeros(2), torch.zeros(3)]
LAYOUT = {"buckets": [[2, 1], [0]], "bytes": [20, 16]}


def _assign(layout: ddp_buckets.Layout, params: list[torch.Tensor]) -> tuple[list[list[int]], list[bool]]:
    """What DDP's constructor gets inside :func:`ddp_buckets._initial_buckets`."""
    applied: list[bool] = []
    with ddp_buckets._initial_buckets(layout, applied):
        buckets, _ = dist._compute_bucket_assignment_by_size(params, [sys.maxsize], [False] * len(params))
    return buckets, applied


def test_ddp_gets_the_saved_layout_in_the_order_it_reverses() -> None:
    buckets, applied = _assign(LAYOUT, PARAMS)
    assert applied == [True]
    assert list(reversed(buckets)) == LAYOUT["buckets"]  # DDP reverses the list into reduction order


@pytest.mark.parametrize(
    "params",
    [[torch.zeros(4), torch.zeros(2), torch.zeros(4)], [torch.zeros(4), torch.zeros(2)]],
    ids=["resized", "fewer"],
)
def test_a_layout_of_another_model_leaves_ddps_own(params: list[torch.Tensor]) -> None:
    original = dist._compute_bucket_assignment_by_size
    buckets, applied = _assign(LAYOUT, params)
    assert applied == []
    assert buckets == [list(range(len(params)))]  # DDP's initial layout: one bucket
    assert dist._compute_bucket_assignment_by_size is original  # put back after the construction


@pytest.mark.parametrize(
    "saved",
    [None, {}, {"buckets": [[0]]}, {"buckets": [[0], []], "bytes": [4, 0]}, {"buckets": [["x"]], "bytes": [4]}],
)
def test_what_is_not_a_layout_is_none(saved: object) -> None:
    assert ddp_buckets.clean(saved) is None


def test_a_layout_comes_back_as_plain_ints() -> None:
    assert ddp_buckets.clean({"buckets": [("2", 1), [0]], "bytes": ["20", 16]}) == LAYOUT


def test_nothing_is_captured_from_a_module_that_is_not_ddp() -> None:
    assert ddp_buckets.capture(torch.nn.Linear(2, 2)) is None


def test_without_a_layout_ddp_is_built_as_ever() -> None:
    made = object()
    assert ddp_buckets.build(lambda: made, None) is made
