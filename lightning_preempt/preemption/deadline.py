"""Will an emergency snapshot fit in the grace period? Warn early, with the numbers."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from lightning_preempt.format.manifest import Manifest

MIN_MARGIN_S = 5.0


def grace_margin(grace_s: float) -> float:
    """Safety margin inside the grace period; the callback's warning uses the same one."""
    return max(MIN_MARGIN_S, 0.1 * grace_s)


class GraceCheck:
    """Projects the snapshot time from measured saves; warns once when it does not fit."""

    def __init__(self, grace_period_s: float) -> None:
        self.grace_period_s = grace_period_s
        self.warned = False

    def check_records(self, records: Sequence[Any]) -> None:
        """From the plugin's ``history`` of :class:`SaveRecord` (the newest committed one)."""
        done = [r for r in records if r.throughput_bps]
        if done:
            r = done[-1]
            self.check(r.blocking_s + r.bytes / r.throughput_bps, r.bytes, r.throughput_bps)

    def check_manifest(self, manifest: Manifest | None) -> None:
        """At start-up, from the stats the newest committed checkpoint recorded."""
        write_s = manifest.stats.get("write_s") if manifest is not None else None
        if manifest is not None and write_s:
            projected = manifest.stats.get("blocking_s", 0.0) + write_s
            self.check(projected, manifest.total_bytes, manifest.total_bytes / write_s)

    def check(self, projected_s: float, nbytes: int, bytes_per_s: float) -> None:
        margin = grace_margin(self.grace_period_s)
        if self.warned or projected_s <= self.grace_period_s - margin:
            return
        self.warned = True
        warnings.warn(
            f"lightning_preempt: a snapshot of {nbytes / 1e9:.2f} GB at the measured {bytes_per_s / 1e6:.0f} MB/s "
            f"takes ~{projected_s:.1f}s, more than grace_period_s={self.grace_period_s:.0f}s minus a "
            f"{margin:.0f}s margin.\nHINT: save to faster (node-local) storage (local_dirpath), save more often "
            "so the emergency snapshot is skipped, or ask the scheduler for a longer grace period.",
            stacklevel=3,
        )

