"""What DCP sends between ranks after the shard files are written, cut to what changed.

After every rank has written, DCP's ``_save_state_dict`` gathers each rank's
``WriteResult`` list to the coordinator (one per tensor: index, size, file, offset) and
broadcasts the coordinator's whole ``Metadata`` back (one entry per tensor). With 4000
tensors on 2 gloo ranks that is ~60-80 ms of pickling, sending and unpickling per save,
while nothing in either message changed since the last save: the plan was reused
(write/planning.py) and every record went to the same place (write/records.py).

* :class:`SentResults`: a rank's results on their way to the coordinator. The first save
  of a file layout sends them in full with the layout's token; while the layout is replayed
  unchanged, only the token travels (``same``), and the coordinator uses the list it kept
  for that rank and token (:meth:`ResultsKept.resolve`). A token the coordinator does not
  hold raises rather than guess; a failed save clears every rank's caches (save/saver.py),
  so the next one sends everything again.
* :class:`KeptMetadata`: the coordinator's ``Metadata`` as DCP's planner returns it. The
  coordinator's writer unwraps it to write ``.metadata``; pickled for DCP's broadcast it is
  ``None``: no rank uses the broadcast value (each rank's files are its own; the commit
  reads the coordinator's manifest, write/commit.py).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult


def new_token() -> str:
    """A token for one file layout's results."""
    return uuid.uuid4().hex


class SentResults(list):  # type: ignore[type-arg]  # list[WriteResult], as DCP passes it on
    """One rank's ``WriteResult`` s, pickled in full or as the token of a list sent before."""

    def __init__(self, results: list[WriteResult], token: str, *, same: bool) -> None:
        super().__init__(results)
        self.token = token
        self.same = same

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_sent_results, (self.token, None if self.same else list(self)))


def _sent_results(token: str, results: list[WriteResult] | None) -> SentResults:
    return SentResults(results or [], token, same=results is None)


class ResultsKept:
    """The coordinator's copy of every rank's last full results, by group rank."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[str, list[WriteResult]]] = {}
        self._lock = threading.Lock()
        #: results that arrived as a token (a rank's list not sent again)
        self.hits = 0

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def resolve(self, results: list[list[WriteResult]]) -> list[list[WriteResult]]:
        """Every rank's full list (``results[r]`` came from group rank ``r``, as DCP gathers
        them). A list kept here is handed out as the same object save after save, so
        ``.metadata``'s cached pickle (write/dcp_metadata.py) recognises it."""
        out: list[list[WriteResult]] = []
        with self._lock:
            for rank, got in enumerate(results):
                if not isinstance(got, SentResults):
                    self._kept.pop(rank, None)
                    out.append(got)
                    continue
                kept = self._kept.get(rank)
                if got.same:
                    if kept is None or kept[0] != got.token:
                        raise RuntimeError(
                            f"rank {rank} sent the token of write results the coordinator does not hold "
                            "(caches out of step); every rank sends its results in full in the next save"
                        )
                    out.append(kept[1])
                    self.hits += 1
                else:
                    full = list(got)
                    self._kept[rank] = (got.token, full)
                    out.append(full)
        return out


class KeptMetadata:
    """The coordinator's ``Metadata``, which DCP's broadcast carries as ``None``."""

    __slots__ = ("metadata",)

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_kept_on_the_coordinator, ())


def _kept_on_the_coordinator() -> None:
    return None


def unwrap_metadata(metadata: Metadata | KeptMetadata) -> Metadata:
    """The ``Metadata`` a writer's ``finish`` got from DCP (wrapped or not)."""
    return metadata.metadata if isinstance(metadata, KeptMetadata) else metadata
