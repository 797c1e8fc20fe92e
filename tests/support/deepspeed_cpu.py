"""Test-only: Lightning's ``DeepSpeedStrategy`` on CPU ranks over gloo (never in the package).

Lightning refuses DeepSpeed without CUDA in three places (FINDINGS.md, "DeepSpeed"); past
them ZeRO trains on CPU. :class:`CPUDeepSpeedStrategy` lifts exactly these three and is a
``DeepSpeedStrategy`` for every ``isinstance`` check:

* ``setup_environment``: its CUDA check (the DDP set-up below it still runs);
* ``setup_distributed``: ``_validate_device_index_selection`` (it wants CUDA indices);
* ``deepspeed.initialize(args=Namespace(device_rank=None))``: the ``args`` are dropped
  (DeepSpeed reads ``device_rank`` from them as a CUDA index).
"""

from __future__ import annotations

from typing import Any

import deepspeed
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # without the CUDA check

    def setup_distributed(self) -> None:
        reset_seed()  # as Lightning's, without _validate_device_index_selection
        self.set_world_ranks()
        self._init_deepspeed_distributed()


_initialize = deepspeed.initialize


def _initialize_without_device_rank(*args: Any, **kwargs: Any) -> Any:
    kwargs.pop("args", None)
    return _initialize(*args, **kwargs)


deepspeed.initialize = _initialize_without_device_rank
