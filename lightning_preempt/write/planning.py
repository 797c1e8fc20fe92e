"""DCP save plans made once and reused while the state's structure is unchanged, and between
ranks not even sent (DCP's ``usable=False`` protocol, a token per rank's plan that the
coordinator checks). Why and when: docs/design.md, "The writer's fast paths"."""

from __future__ import annotations

import dataclasses
import operator
import threading
import uuid
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from lightning_preempt.write.dcp_exchange import KeptMetadata, ResultsKept
from lightning_preempt.write.dcp_metadata import MetadataPickles
from lightning_preempt.write.records import RecordLayout


@dataclasses.dataclass
class PlanCache:
    """The last plans of one saver (see the module docstring). ``hits`` counts reuses."""

    local_key: Any = None
    local_plan: SavePlan | None = None
    all_plans: list[SavePlan] | None = None
    global_plans: list[SavePlan] | None = None
    metadata: Metadata | None = None
    #: this rank's token for ``local_plan``; the coordinator's tokens of ``all_plans``
    local_token: str | None = None
    all_tokens: list[str | None] | None = None
    final_plan: SavePlan | None = None  # this rank's plan as DCP finished it last time
    hits: dict[str, int] = dataclasses.field(default_factory=lambda: {"local": 0, "global": 0, "unsent": 0})
    #: the shard files the plan above wrote, to write again (write/records.py)
    records: RecordLayout | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``.metadata`` pickled for the plan above (write/dcp_metadata.py)
    metadata_pickles: MetadataPickles = dataclasses.field(default_factory=MetadataPickles, repr=False, compare=False)
    #: the coordinator's copy of every rank's write results, sent once per layout (write/dcp_exchange.py)
    results_kept: ResultsKept = dataclasses.field(default_factory=ResultsKept, repr=False, compare=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)
    #: the tensors ``local_key`` was computed from (:class:`_Seen`): the same objects again
    #: need no new key
    seen: _Seen | None = dataclasses.field(default=None, repr=False, compare=False)

    def __reduce__(self) -> tuple[type[PlanCache], tuple[()]]:
        # A pickled or copied saver (ddp_spawn workers, deepcopy of a trainer) plans afresh:
        # the plans name this process's buffers.
        return (PlanCache, ())

    def forget_views(self) -> None:
        """Let go of the staged tensors' views the replayed layout holds (the stager is about
        to drop a buffer: write/records.py)."""
        records = self.records
        if records is not None:
            records.forget_views()

    def clear(self) -> None:
        with self.lock:
            self.local_key = self.local_plan = self.all_plans = self.global_plans = self.metadata = None
            self.local_token = self.all_tokens = self.final_plan = None
            self.records = self.seen = None
        self.results_kept.clear()


@dataclasses.dataclass(frozen=True)
class _Seen:
    """The state a structure key was computed from: its keys, a weak reference to each tensor
    (never keeping a freed buffer alive), their data addresses and sizes."""

    key: Any
    names: list[str]
    refs: list[weakref.ref[torch.Tensor]]
    ptrs: list[int]
    numels: list[int]

    @staticmethod
    def of(key: Any, state_dict: dict[str, Any]) -> _Seen:
        values = list(state_dict.values())
        return _Seen(key, list(state_dict), [weakref.ref(v) for v in values],
                     [v.data_ptr() for v in values], [v.numel() for v in values])  # fmt: skip

    def same(self, state_dict: dict[str, Any]) -> bool:
        """Whether ``state_dict`` holds the very tensor objects seen, under the same keys, at
        the same addresses and sizes: C-level passes (~0.5 ms for 4000 tensors, against ~10 ms
        for a new key). A tensor object keeps its dtype; its shape, strides and storage change
        only through in-place metadata calls (``resize_``, ``set_``, ``as_strided_``), which
        nothing applies to the stager's buffers (the only tensors a saver writes twice: the
        streamed ones are new ``detach()`` objects each save); the address and size checks
        catch most of those anyway."""
        values = list(state_dict.values())
        if len(values) != len(self.refs) or list(state_dict) != self.names:
            return False
        if not all(map(operator.is_, [ref() for ref in self.refs], values)):
            return False
        return [v.data_ptr() for v in values] == self.ptrs and [v.numel() for v in values] == self.numels


def _structure_key(state_dict: dict[str, Any], is_coordinator: bool) -> Any:
    """What the local plan depends on, or ``None`` when this state is not cached."""
    parts: list[Any] = [is_coordinator]
    for key, value in state_dict.items():
        if type(value) is not torch.Tensor or type(key) is not str:  # DTensor, ShardedTensor, bytes: plan afresh
            return None
        # (the data's address, not the storage's: a record holds the tensor's own bytes)
        parts.append((key, value.data_ptr(), value.dtype, value.shape, value.stride(), value.requires_grad))
    return tuple(parts)


def _same_key(a: Any, b: Any) -> bool:
    return a is b or (a is not None and a == b)


class CachingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` reusing the plans in ``cache`` (see the module docstring)."""

    def __init__(self, cache: PlanCache, *, collective: bool = False) -> None:
        super().__init__()
        self._plan_cache = cache
        #: plans travel between ranks: unchanged ones are not sent (module docstring)
        self._unsent = collective
        self._collective = collective
        #: the state is plain tensors (its plans are cached) / this save reused the local plan:
        #: the same buffers as the last save (the writer replays that save's files then)
        self.structure_cached = False
        self.reused_local_plan = False
        self._key: Any = None

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        cache = self._plan_cache
        with cache.lock:
            seen = cache.seen
        prefix = (self._unsent, is_coordinator)
        if seen is not None and (seen.key[0], seen.key[1][0]) == prefix and seen.same(state_dict):
            key = seen.key  # the tensors the last key was computed from: the same key
        else:
            key = _structure_key(state_dict, is_coordinator)
            if key is not None:  # a plan made alone is never offered to a group as unsent, nor back
                key = (self._unsent, key)
                seen = _Seen.of(key, state_dict)
                with cache.lock:
                    cache.seen = seen
        self._key, self.structure_cached = key, key is not None
        if key is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        # A flat dict of plain tensors under str keys: DCP's two flattening passes (~5 us a
        # tensor) would map every key to itself.
        with cache.lock:
            plan = cache.local_plan if _same_key(key, cache.local_key) else None
        mappings = plan.planner_data if plan is not None else None
        self.mappings = mappings if isinstance(mappings, dict) else {k: (k,) for k in state_dict}
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        cache = self._plan_cache
        key = self._key
        with cache.lock:
            if key is not None and _same_key(key, cache.local_key) and cache.local_plan is not None:
                cache.hits["local"] += 1
                self.plan = cache.local_plan
                self.reused_local_plan = True
                if self._unsent and cache.local_token is not None:
                    token = _Token(cache.local_token)
                    if cache.final_plan is not None:  # the coordinator holds it: send nothing
                        return SavePlan([], storage_data=token, usable=False)
                    return dataclasses.replace(self.plan, storage_data=token)
                return self.plan
        plan = super().create_local_plan()
        with cache.lock:
            cache.local_key, cache.local_plan = (key, plan) if key is not None else (None, None)
            cache.local_token = uuid.uuid4().hex if key is not None else None
            cache.final_plan = None  # (set once DCP finishes this plan)
            if self._unsent and cache.local_token is not None:
                return dataclasses.replace(plan, storage_data=_Token(cache.local_token))
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = self._global_plan_reused(all_plans)
        # DCP broadcasts the metadata to every rank after the write; only the coordinator's
        # writer uses it (write/dcp_exchange.py): across ranks it travels as None.
        return plans, KeptMetadata(metadata) if self._collective else metadata  # type: ignore[return-value]

    def _global_plan_reused(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self._plan_cache
        tokens = [p.storage_data.value if isinstance(p.storage_data, _Token) else None for p in all_plans]
        if any(not p.usable for p in all_plans):
            with cache.lock:
                held = cache.all_tokens
                if held is None or cache.all_plans is None or len(held) != len(all_plans) or any(
                    not p.usable and (t is None or t != h) for p, t, h in zip(all_plans, tokens, held, strict=True)
                ):
                    raise RuntimeError(
                        "a rank reused a save plan the coordinator does not hold (plan caches out of step); "
                        "every rank plans afresh in the next save"
                    )
                if all(not p.usable for p in all_plans) and cache.global_plans is not None and cache.metadata is not None:
                    cache.hits["unsent"] += 1
                    self.global_plan, self.metadata = cache.global_plans, cache.metadata
                    return [SavePlan([], usable=False) for _ in all_plans], self.metadata
                all_plans = [c if not p.usable else p for p, c in zip(all_plans, cache.all_plans, strict=True)]
        # (the tokens ride in storage_data, where the writer puts each rank's file prefix next)
        all_plans = [dataclasses.replace(p, storage_data=None) if isinstance(p.storage_data, _Token) else p
                     for p in all_plans]  # fmt: skip
        with cache.lock:
            if (
                cache.all_plans is not None
                and cache.global_plans is not None
                and cache.metadata is not None
                and len(all_plans) == len(cache.all_plans)
                and all(x is y or x == y for x, y in zip(all_plans, cache.all_plans, strict=True))
            ):
                cache.hits["global"] += 1
                cache.all_tokens = tokens if self._unsent else None
                self.global_plan, self.metadata = cache.global_plans, cache.metadata
                return list(self.global_plan), self.metadata
        global_plans, metadata = super().create_global_plan(all_plans)
        with cache.lock:
            cache.all_plans, cache.global_plans, cache.metadata = list(all_plans), list(global_plans), metadata
            cache.all_tokens = tokens if self._unsent else None
        return global_plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        cache = self._plan_cache
        if not new_plan.usable:
            with cache.lock:
                final = cache.final_plan
            if final is None:  # (the coordinator checked the token: cannot happen)
                raise RuntimeError("the coordinator sent no plan and this rank holds none")
            self.plan = final
            return final
        plan = super().finish_plan(new_plan)
        with cache.lock:
            cache.final_plan = plan if self._plan_cache.local_key is not None else None
        return plan


@dataclasses.dataclass(frozen=True)
class _Token:
    """Names one rank's cached local plan (see the module docstring)."""

    value: str
