"""A hand-written Fabric training loop that survives preemption (docs/fabric.md).

A small GPT-like model (token and position embeddings, one causal transformer block, a
language-model head) learns synthetic token sequences. ``Preemption`` resumes it from the
newest valid checkpoint in ``--dirpath`` on every (re)start, saves every ``--every`` steps
(asynchronously: ``fabric.save`` only waits for the host copy), and on SIGTERM to any rank
makes every rank snapshot the same step and exit with 143 (requeued under SLURM).

    python examples/fabric_train.py --devices 2                 # CPU, 2 ranks (gloo)
    kill -TERM <pid of either rank>                             # exits 143 after a snapshot
    python examples/fabric_train.py --devices 2                 # resumes where it stopped
    lightning-preempt ls checkpoints/fabric-demo                # the operator view

Run it again with ``--devices 1``: a 2-rank checkpoint resumes on one rank.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.fabric import Preemption


class TinyGPT(torch.nn.Module):
    """Embeddings, causal transformer blocks and a language-model head."""

    def __init__(self, vocab: int = 64, dim: int = 32, context: int = 16, layers: int = 1) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(context, dim))
        block = torch.nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.1, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tok(idx) + self.pos[:n]
        return self.head(self.blocks(x, mask=self.mask[:n, :n], is_causal=True))


def synthetic_tokens(n: int = 96, context: int = 16, vocab: int = 64) -> TensorDataset:
    """``n`` random sequences; inputs and next-token targets."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (n, context + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dirpath", default="checkpoints/fabric-demo")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="save every N optimizer steps")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (time to send a signal)")
    args = p.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                      plugins=[ShardedAsyncCheckpointIO()])  # fmt: skip
    fabric.launch()
    fabric.seed_everything(1234)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(synthetic_tokens(), batch_size=4, shuffle=True))

    preempt = Preemption(fabric, dirpath=args.dirpath, every_n_train_steps=args.every)
    # Everything the loop needs to continue: modules, optimizers, counters. The loader's
    # position and the RNG states are saved by Preemption itself.
    state = {"model": model, "optimizer": optimizer, "step": 0}
    preempt.resume(state)  # every rank; loads the newest valid checkpoint, or nothing on a fresh start
    fabric.print(f"starting at step {state['step']} (epoch {preempt.epoch})")
    for i, (x, y) in enumerate(preempt.iterate(loader, state, max_epochs=args.epochs)):
        last = (i + 1) % args.accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            fabric.backward(loss / args.accumulate)
        if last:
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1  # the step boundary is when the loop asks for the next batch
            if state["step"] % 10 == 0:
                fabric.print(f"step {state['step']}: loss {loss.item():.3f}")
        time.sleep(args.step_sleep)
    preempt.finish(state)  # the final save, every commit waited for
    fabric.print(f"done at step {state['step']}")


if __name__ == "__main__":
    main()
