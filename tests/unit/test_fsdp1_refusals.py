"""FSDP1 set-ups whose state would be ``ShardedTensor`` are refused with a HINT before any step
(lightning/sharded_saves.py); the multi-rank behaviour is in tests/multiproc/test_fsdp1.py."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.sharded_saves import install_fsdp, without_mesh


def test_hybrid_sharding_without_a_mesh_is_refused() -> None:
    with pytest.raises(ValueError, match=r"HINT: pass device_mesh=\(num_nodes, devices_per_node\)"):
        strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={torch.nn.Linear})
        install_fsdp(strategy, ShardedAsyncCheckpointIO())


def test_a_process_group_instead_of_a_mesh_is_refused() -> None:
    strategy = FSDPStrategy(process_group=object())
    with pytest.raises(ValueError, match=r"HINT: pass device_mesh=\.\.\. instead of process_group"):
        install_fsdp(strategy, ShardedAsyncCheckpointIO())
    assert strategy.kwargs.get("device_mesh") is None  # nothing given to FSDP


def test_a_plain_module_has_no_fsdp_module_without_a_mesh() -> None:
    assert not without_mesh(torch.nn.Linear(2, 2))
