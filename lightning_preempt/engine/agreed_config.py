"""The options every rank must share, compared in one collective at set-up.

Each process builds its own :class:`~lightning_preempt.engine.config.PreemptionConfig`: under
Lightning's DDP launcher every rank runs the user's script again, so a ``dirpath`` with a
timestamp or a random run name differs from rank to rank: each rank would write its shard into
its own directory, under manifests listing files rank 0 never saw. A difference in an option
that decides a collective (``resume``, ``lease``, tier 0, the save interval…) hangs the ranks.

Lightning's ``ModelCheckpoint`` broadcasts rank 0's ``dirpath``; we refuse, on every rank, with
the differences and a HINT (docs/design.md "Ranks agree on their options"): by set-up each
rank has already looked for a checkpoint to resume in its own ``dirpath``, and a name that
differs by rank is also new on every restart, so auto-resume could never find the previous
run's checkpoints; rank 0's value winning would hide that.
"""

from __future__ import annotations

import json
from typing import Any

from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig

#: The options compared, and why a difference breaks the run. Node-local places
#: (``local_dirpath``, ``memory_dirpath``: only whether they are on), credentials
#: (``storage_options``), the exit codes, the signals and the notices may differ.
MUST_MATCH: dict[str, str] = {
    "dirpath": "every rank writes its shard there; rank 0's manifest lists them all",
    "every_n_train_steps": "a periodic save is collective: taken at the same steps on every rank",
    "keep_last_n": "retention deletes what another rank's tier still counts on",
    "grace_period_s": "the emergency sequence's budget on every rank",
    "agree_every_n_steps": "the boundary agreement is a collective at the same steps",
    "overlap_agreement": "the boundary agreement is a collective at the same steps",
    "resume": "the resume choice is collective",
    "save_on_train_end": "the final save is collective",
    "lease": "taking the lease is collective",
    "probe_storage": "the storage probe is collective",
    "on_notice": "a notice's snapshot either ends the run or not, on every rank alike",
    "global_batch": "the accumulation after a resize, or the ranks train different batches",
    "detect_failures": "the heartbeats start collectively",
    "heartbeat_timeout_s": "when a silent peer counts as lost",
    "tier0_every_n_steps": "tier 0's set-up and copies are collective",
    "two_tier": "the local tier's drain group is made collectively (local_dirpath on or off)",
    "sharded_keys": "which keys go to the shards: the checkpoint's layout",
    "verify_on_load": "the resume choice's checks are collective",
}

#: The gathered options of one rank, JSON: a long ``dirpath`` fits many times over.
_MAX_BYTES = 64 * 1024


class RanksDisagreeError(ValueError):
    """The ranks built different values for options that must match (raised on every rank)."""


def options(config: PreemptionConfig, *, two_tier: bool, sharded_keys: tuple[str, ...],
            verify_on_load: bool) -> dict[str, Any]:  # fmt: skip
    """This rank's values of :data:`MUST_MATCH`, as JSON values."""
    values: dict[str, Any] = {name: getattr(config, name) for name in MUST_MATCH if hasattr(config, name)}
    values.update(two_tier=two_tier, sharded_keys=list(sharded_keys), verify_on_load=verify_on_load)
    return dict(json.loads(json.dumps(values)))  # as every other rank's arrive (tuples as lists)


def differences(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per option whose value is not the same on every rank: each value and its ranks."""
    lines = []
    for name in MUST_MATCH:
        by_value: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            by_value.setdefault(json.dumps(values.get(name)), []).append(rank)
        if len(by_value) > 1:
            shown = [f"{value} on rank{'s' * (len(ranks) > 1)} {_ranks(ranks)}" for value, ranks in by_value.items()]
            more = f", and {len(shown) - 4} more values" if len(shown) > 4 else ""
            lines.append(f"  {name}: " + "; ".join(shown[:4]) + more)
    return lines


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8})" if len(ranks) > 8 else "")


def check_ranks_agree(
    config: PreemptionConfig, group: pdist.ProcessGroup | None, *, two_tier: bool, sharded_keys: tuple[str, ...],
    verify_on_load: bool,
) -> None:  # fmt: skip
    """Raise :class:`RanksDisagreeError` on every rank when an option of :data:`MUST_MATCH`
    differs between ranks. Collective (one all-gather): every rank of ``group`` calls it."""
    if group is None or not pdist.is_distributed():
        return
    mine = options(config, two_tier=two_tier, sharded_keys=sharded_keys, verify_on_load=verify_on_load)
    lines = differences(pdist.all_gather_json(mine, group, max_bytes=_MAX_BYTES))
    if not lines:
        return
    raise RanksDisagreeError(
        "lightning_preempt: the ranks of this job built different values for options that must be the "
        "same on every rank (nothing was saved or loaded):\n" + "\n".join(lines) + "\n"
        "HINT: every rank runs your script and builds its own PreemptionCallback; compute dirpath (and "
        "these options) from something every rank shares: a fixed name, or an environment variable set "
        "before the launch (e.g. a run name from SLURM_JOB_ID), not a timestamp, a random id or the rank. "
        "A name that changes on every start also defeats auto-resume after a preemption."
    )
