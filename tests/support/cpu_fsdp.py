"""FSDP1 (Lightning's ``FSDPStrategy``) on CPU over gloo, for tests only.

Lightning stands in the way of FSDP1 on CPU (torch's FSDP1 itself trains there when given
``device_id=torch.device("cpu")``), and this subclass lifts exactly those obstacles:

* the accelerator connector refuses ``FSDPStrategy`` without a GPU, but only for that exact
  type (``type(strategy) is FSDPStrategy``): a subclass passes;
* ``_setup_model`` passes ``device_id=self.root_device.index``, ``None`` on CPU, which FSDP1
  takes for "the current CUDA device": here ``torch.device("cpu")``.

Everything else (the state dict contexts, the saves and loads) is Lightning's and ours.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy


class CPUFSDPStrategy(FSDPStrategy):
    def _setup_model(self, model: torch.nn.Module) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
        )  # fmt: skip


def fabric_cpu_fsdp(**kwargs: Any) -> Any:
    """Fabric's ``FSDPStrategy`` on CPU: the same two obstacles (the connector's check for the
    exact type, ``device_id=None``), and a ``device_mesh`` tuple made into a mesh on "cpu"
    (Fabric makes it on "cuda")."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy

    class CPUFabricFSDPStrategy(FabricFSDPStrategy):
        def setup_environment(self) -> None:
            mesh = self._fsdp_kwargs.get("device_mesh")
            self._fsdp_kwargs.pop("device_mesh", None)
            super().setup_environment()
            if isinstance(mesh, tuple):
                from torch.distributed.device_mesh import init_device_mesh

                self._fsdp_kwargs["device_mesh"] = init_device_mesh("cpu", mesh)

        def setup_module(self, module: torch.nn.Module) -> Any:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=module, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self._fsdp_kwargs,
            )  # fmt: skip

    return CPUFabricFSDPStrategy(**kwargs)
