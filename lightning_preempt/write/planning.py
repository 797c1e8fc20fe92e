"""DCP's own plan caching (``DefaultSavePlanner(enable_plan_caching=True)``: a rank's unchanged
plan is not sent, the coordinator reuses its global plan and metadata, every rank its final
plan), kept per saver, and the local plan not even made while the save's structure key
(format/structure.py) is the one it was made for. Why and when: docs/design.md, "The writer's
fast paths"."""

from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from lightning_preempt.format.dcp_compat import cached_plan, forget_cached_plans
from lightning_preempt.format.structure import Structure
from lightning_preempt.write.dcp_exchange import KeptMetadata, ResultsKept
from lightning_preempt.write.dcp_metadata import MetadataPickles
from lightning_preempt.write.records import RecordLayout


@dataclasses.dataclass
class PlanCache:
    """One saver's plans: its key into DCP's caches, the structure key (and keys) DCP's cached
    local plan was made for, and what the writer derives from a plan. ``hits``: local plans not
    made, saves whose plans none of the ranks sent (counted by the coordinator)."""

    #: DCP keys its caches on the planner's class name alone: two savers in one process (a
    #: collective one and a single-process one) would share them. Each saver gets its own key.
    key: str = dataclasses.field(default_factory=lambda: f"lightning_preempt-{uuid.uuid4().hex}")
    structure: Structure | None = None
    keys: list[str] | None = None
    hits: dict[str, int] = dataclasses.field(default_factory=lambda: {"local": 0, "unsent": 0})
    #: the shard files the plan above wrote, to write again (write/records.py)
    records: RecordLayout | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``.metadata`` pickled for the plan above (write/dcp_metadata.py)
    metadata_pickles: MetadataPickles = dataclasses.field(default_factory=MetadataPickles, repr=False, compare=False)
    #: the coordinator's copy of every rank's write results, sent once per layout (write/dcp_exchange.py)
    results_kept: ResultsKept = dataclasses.field(default_factory=ResultsKept, repr=False, compare=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        weakref.finalize(self, forget_cached_plans, self.key)  # DCP's dicts would keep a dropped saver's plans

    def forget_views(self) -> None:
        """Let go of the staged tensors' views the replayed layout holds (they keep the buffers
        alive, and the stager is about to drop one); the next replay makes them again."""
        records = self.records
        if records is not None:
            records.segments = None

    def clear(self) -> None:
        with self.lock:
            self.structure = self.keys = self.records = None
            forget_cached_plans(self.key)
        self.results_kept.clear()


class CachingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner(enable_plan_caching=True)`` on ``cache`` (see the module docstring)."""

    def __init__(self, cache: PlanCache, structure: Structure | None = None, *, collective: bool = False) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = cache.key
        self._plan_cache = cache
        self._structure = structure
        #: DCP broadcasts the coordinator's metadata to every rank, which none uses (below)
        self._collective = collective
        #: the state is plain tensors under the save's structure key (its local plan is cached) /
        #: this save reused the local plan (the writer replays that save's files then)
        self.structure_cached = structure is not None and structure.plain
        self.reused_local_plan = False

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        if not self.structure_cached:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        # A flat dict of plain tensors under str keys: DCP's two flattening passes (~5 us a
        # tensor) would map every key to itself.
        self.mappings = {}  # (made in create_local_plan when a plan is made)
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        cache = self._plan_cache
        keys = list(self.state_dict) if self.structure_cached else None
        with cache.lock:
            cached = cached_plan(cache.key, "save_plan")
            if keys is not None and cache.structure is self._structure and cache.keys == keys and cached is not None:
                # What DCP would make and find equal to its cached plan (~0.1 ms a tensor), not made:
                # DCP's reply to an unchanged plan follows (the coordinator's cached plans).
                cache.hits["local"] += 1
                self.plan, self.reused_local_plan = cached, True
                return SavePlan([], usable=False)
            cache.structure = cache.keys = None  # (set once DCP has finished the plan made now)
        if keys is not None:
            self.mappings = {k: (k,) for k in keys}
        return super().create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if any(not p.usable for p in all_plans) and cached_plan(self._cached_plans_key, "all_plans") is None:
            # DCP would plan without that rank's tensors
            raise RuntimeError(
                "a rank reused a save plan the coordinator does not hold (plan caches out of step); "
                "every rank plans afresh in the next save"
            )
        if all(not p.usable for p in all_plans):
            self._plan_cache.hits["unsent"] += 1
        plans, metadata = super().create_global_plan(all_plans)
        # DCP broadcasts the metadata to every rank after the write; only the coordinator's
        # writer uses it (write/dcp_exchange.py): across ranks it travels as None.
        return plans, KeptMetadata(metadata) if self._collective else metadata  # type: ignore[return-value]

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)  # DCP keeps the local plan made in this save now
        if self.structure_cached and not self.reused_local_plan:
            with self._plan_cache.lock:
                self._plan_cache.structure, self._plan_cache.keys = self._structure, list(self.state_dict)
        return plan
