"""A 2-rank ``strategy="ddp"`` fit under Lightning's own launcher, for the listening sockets
(tests/e2e/test_rendezvous_bind.py; docs/security.md, "Who can reach the stores").

At step 2 rank 0 writes ``MASTER_PORT`` to ``<out>/master_port`` and every rank waits for
``<out>/go``. ``--bound-store``: docs/elastic.md's recipe for a one-node job, the launching
process hosts the workers' store on loopback (``bound_tcp_store``) and every rank joins it
as a client (``TORCHELASTIC_USE_AGENT_STORE``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OUT = Path(sys.argv[1])
if "--bound-store" in sys.argv and "LOCAL_RANK" not in os.environ:  # the launching process: rank 0
    from lightning_preempt.elastic import bound_tcp_store

    STORE = bound_tcp_store("127.0.0.1", 0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(STORE.port), TORCHELASTIC_USE_AGENT_STORE="True")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            if self.global_rank == 0:
                (OUT / "master_port.tmp").write_text(os.environ["MASTER_PORT"])
                os.replace(OUT / "master_port.tmp", OUT / "master_port")
            deadline = time.monotonic() + 120
            while not (OUT / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
trainer.fit(Job(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
