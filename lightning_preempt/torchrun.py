"""``python -m lightning_preempt.torchrun ARGS`` = ``torchrun ARGS`` with the exit code a
scheduler expects (143 for a preempted node, not 1): see :mod:`lightning_preempt.elastic`."""

from __future__ import annotations

import logging
import os
import sys

from lightning_preempt.elastic import run

if __name__ == "__main__":
    code = run()
    # The agent's work is done (workers reaped, SLURM requeued, the line printed): leave
    # without interpreter finalization. After a SIGTERM the rendezvous/store C++ threads
    # may still be joinable when their owners are destroyed at exit, and libstdc++ then
    # aborts ("terminate called without an active exception": exit -6 instead of 143),
    # which a scheduler reads as a crash. Seen once in CI under load.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
