"""The private torch/Lightning names lightning_preempt relies on exist in the installed versions.

Fast, no training. The minimum-versions job (scripts/test_min_versions.sh) runs it on the
oldest torch and Lightning pyproject.toml accepts, so a floor that lacks one fails here with
the name, not somewhere deep in a training run. docs/compat.md lists these uses.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import lightning as L
import pytest
import torch

# (module, attribute) of every private name the package uses (format/dcp_compat.py, lightning/_compat/).
PRIVATE_NAMES = [
    ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),  # format/dcp_compat.py
    ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"),
    ("torch.distributed.checkpoint._fsspec_filesystem", "FileSystem"),
    ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch.serialization", "get_crc32_options"),  # write/dcp_writer.py wraps it
    ("torch.distributed", "_compute_bucket_assignment_by_size"),  # resume/ddp_buckets.py
    ("lightning.fabric.utilities.data", "_set_sampler_epoch"),  # lightning/_compat/trainer.py
    ("lightning.fabric.wrappers", "_unwrap_objects"),  # lightning/_compat/fabric.py fabric_save
    ("lightning.pytorch.trainer.connectors.callback_connector", "_CallbackConnector"),
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector"),  # .resume_start
]


def test_fabric_internals_used_by_the_fabric_front_end() -> None:
    from lightning.fabric.strategies.strategy import Strategy
    from lightning.fabric.wrappers import _FabricDataLoader
    from torch.utils.data import DataLoader

    assert callable(getattr(Strategy, "_convert_stateful_objects_in_state", None))
    assert _FabricDataLoader(DataLoader(range(4)))._dataloader is not None


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES, ids=[f"{m}.{n}" for m, n in PRIVATE_NAMES])
def test_private_name_exists(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone in torch {torch.__version__}"


def test_package_imports_every_module() -> None:
    import pkgutil

    import lightning_preempt

    for info in pkgutil.walk_packages(lightning_preempt.__path__, "lightning_preempt."):
        importlib.import_module(info.name)


def test_trainer_internals_used_by_exact_resume(tmp_path: Path) -> None:
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO
    from lightning_preempt.lightning import _compat

    PreemptionCallback(str(tmp_path))
    assert getattr(_CallbackConnector._configure_checkpoint_callbacks, "_lightning_preempt", False)
    assert getattr(_CheckpointConnector._parse_ckpt_path, "_lightning_preempt", False)  # quiet_ckpt_path_choice
    ShardedAsyncCheckpointIO()
    assert getattr(_CallbackConnector._attach_model_callbacks, "_lightning_preempt", False)  # at_fit_setup
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert _compat.train_loaders(trainer) == []
    assert _compat.train_fetcher(trainer) is None
    assert hasattr(trainer.fit_loop, "_combined_loader") and hasattr(trainer.fit_loop, "_data_fetcher")
    assert _compat.training_results(trainer) is not None
    assert hasattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed")
    assert hasattr(trainer.fit_loop.epoch_progress.current, "processed")


def test_ddp_internals_used_by_the_bucket_layout() -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
    from torch.nn.parallel import DistributedDataParallel

    from lightning_preempt.lightning import _compat

    assert callable(getattr(DistributedDataParallel, "_get_ddp_logging_data", None))  # resume/ddp_buckets.py
    ddp = DDPStrategy()
    assert _compat.build_ddp_through(ddp, lambda strategy, make: make())
    assert not _compat.build_ddp_through(ddp, lambda strategy, make: make())  # once
    assert not _compat.build_ddp_through(ModelParallelStrategy(), lambda strategy, make: make())
    assert not _compat.build_ddp_through(SingleDeviceStrategy(), lambda strategy, make: make())


def test_torchmetrics_internals_used_by_exact_resume() -> None:
    import torchmetrics

    from lightning_preempt.resume import exact_state as metrics

    metric = torchmetrics.MeanSquaredError()
    assert metrics.metric_state_names(metric) == ["sum_squared_error", "total"]
    metric(torch.ones(2), torch.zeros(2))
    assert metrics.metric_update_count(metric) == 1
    metrics.set_metric_update_count(metric, 3)
    assert metrics.metric_update_count(metric) == 3 and metric._computed is None
    assert metrics.metric_state_names(torch.nn.Linear(1, 1)) is None


def test_lightning_sampler_wrapper_layout_used_by_exact_resume() -> None:
    """resume/samplers.py finds the user's sampler inside Lightning's DistributedSamplerWrapper
    by its layout (no Lightning import there): the wrapper keeps it at ``dataset._sampler``."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import RandomSampler

    from lightning_preempt.resume.samplers import distributed_wrapped_sampler

    inner = RandomSampler(range(8))
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=0)
    assert distributed_wrapped_sampler(wrapper) is inner
    assert distributed_wrapped_sampler(inner) is None


@pytest.mark.objectstore
def test_s3_conditional_put_is_create_only() -> None:
    """The fsspec/s3fs floors: ``pipe_file(mode="create")`` sends ``If-None-Match: *``, so a
    second create of one key fails instead of overwriting (what the manifest commit relies on;
    older s3fs drops ``mode``). The GCS emulator ignores ``ifGenerationMatch``: S3 only."""
    import fsspec
    from servers import start_s3

    server = start_s3()
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
        path = f"{server.bucket}/create-only/manifest.json"
        fs.pipe_file(path, b"first", mode="create")
        with pytest.raises(FileExistsError):
            fs.pipe_file(path, b"second", mode="create")
        fs.invalidate_cache()
        assert fs.cat_file(path) == b"first"
    finally:
        server.stop()
