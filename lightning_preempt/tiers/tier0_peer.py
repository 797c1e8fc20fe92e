"""Tier 0 across nodes: which ranks share a tier-0 directory, and the restore from peers.

Tier 0 (tiers/tier0.py) keeps each node's ranks' shares in that node's memory. With ranks
on several nodes a copy is complete only together: the engine (engine/memory_tier.py) then
sends every share to the next node after each copy commits (:func:`~lightning_preempt.tiers.peer.replicate`,
the peer replica's transfer, into the *same* ``step-N`` directory there), so with two
nodes each node holds the whole copy and with more each holds its own share and its
predecessor's. This module holds the collective pieces that need no saver:

* :func:`memory_nodes`: the ranks that see one tier-0 directory (a probe file each),
  the "nodes" of tier 0. A host name is not enough: two hosts may share an NFS directory,
  two network namespaces on one machine (the tests) share ``/dev/shm`` unless each node
  mounts its own.
* :func:`restore`: before the resume choice, the newest copy the nodes hold *together*
  (every file of its committed manifest, at its size, on some node) is completed on every
  node that lacks files of it (a replacement node with an empty ``/dev/shm``, or a copy
  whose peer transfer was cut): the holders send the missing files, each receiver checks
  its CRC32C against the manifest and writes it durably, and the manifest goes last. The
  resolver then finds it complete on rank 0's node and every rank loads its own node's copy.

Collective: every rank of ``group`` calls each function, in the same order.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.manifest import Manifest, parse_manifest
from lightning_preempt.format.names import HIDDEN_PREFIX, MANIFEST_NAME
from lightning_preempt.storage.private import PRIVATE_HINT, UnsafePathError, private_dirs
from lightning_preempt.storage.store import Store
from lightning_preempt.tiers import tier0
from lightning_preempt.tiers.peer import (
    WIRE_MAX_BYTES,
    ReplicaError,
    gather_holdings,
    plan_union,
    raise_failed,
    read_own,
    transfer,
    write_durable,
)
from lightning_preempt.tiers.tier0 import MEMORY_HINT, is_default_root, own_components

log = logging.getLogger(__name__)

_PROBE = HIDDEN_PREFIX + "tier0-probe-"


def memory_nodes(root: str, group: dist.ProcessGroup | None) -> list[str] | None:
    """For every rank, the name of the tier-0 "node" it is on: ``tier0-<lowest rank that
    sees the same directory>``. ``None`` when the ranks' views disagree (rank a sees rank
    b's probe, b does not see a's: no sound grouping). Collective over ``group``; raises
    :class:`OSError` on every rank when some rank could not create its probe file.

    Each rank creates an empty probe file in ``root``, the ranks agree that all exist, each
    lists which probes it sees, and removes its own."""
    token = uuid.uuid4().hex
    probe = os.path.join(root, _PROBE + token)
    made: str | None = None
    try:
        with open(probe, "x"):
            pass
    except OSError as err:
        made = f"{type(err).__name__}: {err}"
    views = pdist.all_gather_json({"token": token, "error": made}, group, max_bytes=WIRE_MAX_BYTES)
    failed = [f"rank {r}: {v['error']}" for r, v in enumerate(views) if v["error"] is not None]
    if failed:  # every rank raises here alike (a full tmpfs has no inode left, a read-only one)
        if made is None:
            _remove(probe)
        raise OSError(f"cannot create a probe file in {root} ({failed[0]})")
    try:
        present = set(os.listdir(root))
    except OSError:
        present = set()
    seen = [r for r, v in enumerate(views) if v["error"] is None and _PROBE + v["token"] in present]
    sights = pdist.all_gather_json(seen, group, max_bytes=WIRE_MAX_BYTES)
    _remove(probe)
    nodes: list[str] = []
    for rank, group_of in enumerate(sights):
        if rank not in group_of or any(sights[other] != group_of for other in group_of):
            return None
        nodes.append(f"tier0-{min(group_of)}")
    return nodes


def _remove(probe: str) -> None:
    try:
        os.remove(probe)
    except OSError as err:  # an empty hidden file is left behind; nothing reads it
        log.debug("lightning_preempt: could not remove the tier-0 probe %s: %s", probe, err)


_DISK = "The restart resumes from the disk tiers instead; nothing there is touched."


def restore(
    root: str, group: dist.ProcessGroup | None, nodes: list[str], floor: Callable[[], int], dirpath: str | None = None
) -> int | None:
    """Complete on every node the newest tier-0 copy the nodes hold together (module
    docstring). ``nodes``: :func:`memory_nodes`' answer. ``floor``: the newest step
    committed on the disk tiers (asked on rank 0 only when something must be sent): an older
    copy would not be resumed from, so it is not restored (a tie goes to tier 0 in the
    resolver: restored).

    Returns the step completed (the same on every rank), or ``None`` when nothing needed
    completing (or nothing could be). Raises :class:`ReplicaError` on every rank when a transfer or a write failed (the
    copies that did arrive stay uncommitted where the manifest did not follow)."""
    started = time.monotonic()
    holdings = gather_holdings(root, -1, group)
    plan = plan_union(holdings)
    if plan is None:
        return None
    name, raw, _ = plan
    manifest = parse_manifest(raw, path=os.path.join(root, name))
    moves, commits = _plan_moves(holdings, nodes, name, raw, manifest)
    if not commits:
        return None  # complete on every node already
    step = manifest.step
    if step < agree.decide(floor, group, what="listing the disk tiers", json_max_bytes=WIRE_MAX_BYTES):
        log.info("lightning_preempt: tier 0's step %d is older than the disk tiers': not restored", step)
        return None
    me = pdist.rank(group)
    local_dir = os.path.join(root, name)
    what = f"restoring tier 0's step {step} from the peers"
    data: dict[str, bytes] = {}
    err: str | None = None
    try:
        data = read_own(Store(local_dir), manifest, sorted({f for s, _, f in moves if s == me}))
        if any(r == me for _, r, _ in moves) or me in commits:
            os.makedirs(local_dir, exist_ok=True)
    except (OSError, CheckpointError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    raise_failed(pdist.all_gather_json(err, group, max_bytes=WIRE_MAX_BYTES), f"{what} (reading)", local_dir, _DISK)
    _, _, err = transfer(local_dir, manifest, data, moves, me, group)
    raise_failed(pdist.all_gather_json(err, group, max_bytes=WIRE_MAX_BYTES), f"{what} (sending)", local_dir, _DISK)
    err = None
    if me in commits:  # last: every file of this node's copy is durable (the gather above)
        try:
            write_durable(os.path.join(local_dir, MANIFEST_NAME), raw)
        except OSError as exc:
            err = f"{type(exc).__name__}: {exc}"
    raise_failed(pdist.all_gather_json(err, group, max_bytes=WIRE_MAX_BYTES), f"{what} (committing)", local_dir, _DISK)
    if dirpath is not None:
        _vouch(root, dirpath, manifest.run_id, group, me in commits)
    bytes_sent = sum(manifest.files[f].size for _, _, f in moves)
    log.warning("lightning_preempt: tier 0's step %d completed on %d node(s) from their peers (%d files, %.1f MB, "
                "%.2f s)", step, len(commits), len(moves), bytes_sent / 1e6, time.monotonic() - started)  # fmt: skip
    return step


def _vouch(root: str, dirpath: str, run_id: str | None, group: dist.ProcessGroup | None, received: bool) -> None:
    """Collective: a node that received the copy records its run as this dirpath's (tier0.claim)
    when a node that held it had recorded that run: a replaced node's memory starts empty, and
    the resolver takes only copies of a run recorded on its node."""
    vouched = {r for runs in pdist.all_gather_json(sorted(tier0.whose(root, dirpath)), group,
                                                  max_bytes=WIRE_MAX_BYTES) for r in runs}  # fmt: skip
    if received and run_id is not None and run_id in vouched:
        try:
            tier0.claim(root, dirpath, run_id)
        except OSError as err:  # the copy then stays unused here: the disk tiers are resumed
            log.warning("lightning_preempt: tier 0 cannot record the restored copy's run in %s: %s", root, err)


def _plan_moves(
    holdings: list[dict[str, dict[str, Any]]], nodes: list[str], name: str, raw: bytes, manifest: Manifest
) -> tuple[list[tuple[int, int, str]], list[int]]:
    """Pure, the same on every rank: ``(sender, receiver, file)`` for every file of ``name``
    that a node lacks (its first rank's listing speaks for the node: they share the
    directory), senders and receivers spread over the ranks; and the rank of each node that
    writes the manifest there (a node that lacks a file or the manifest itself)."""
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in dict.fromkeys(nodes)}

    def has(rank: int, file: str) -> bool:
        return holdings[rank].get(name, {}).get("files", {}).get(file) == manifest.files[file].size

    moves: list[tuple[int, int, str]] = []
    commits: list[int] = []
    for node, ranks in members.items():
        lead = ranks[0]
        missing = [f for f in sorted(manifest.files) if not has(lead, f)]
        for i, file in enumerate(missing):
            holders = [r for r in range(len(nodes)) if nodes[r] != node and has(r, file)]
            if not holders:  # held on this node only, yet not by its first rank: views raced
                raise ReplicaError(f"restoring tier 0's step {manifest.step}: {file} is on {node} only",
                                   hint="The restart resumes from the disk tiers instead.")  # fmt: skip
            moves.append((holders[i % len(holders)], ranks[i % len(ranks)], file))
        if missing or holdings[lead].get(name, {}).get("manifest") != raw:
            commits.append(lead)
    return moves, commits


#: Marks a set-up error that is a refusal (storage/private.py): a path another user could control.
REFUSED = "refused: "


def make_root(root: str) -> str:
    """Make tier 0's directory ``root`` private (storage/private.py: 0700, this uid's, never
    through a symlink); ``""``, or why not (a refusal starts with :data:`REFUSED`)."""
    try:
        private_dirs(root, own=own_components(root))
    except UnsafePathError as err:
        return f"{REFUSED}{err}"
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return ""


def raise_if_refused(errors: list[str], root: str) -> None:
    """A ``memory_dirpath`` the user gave that some rank refused: the same error on every
    rank (``errors``: gathered). The default directory's refusal turns tier 0 off instead."""
    refused = [e for e in errors if e.startswith(REFUSED)]
    if refused and not is_default_root(root):
        raise CheckpointError(f"tier 0's memory_dirpath is not private to this user: {refused[0][len(REFUSED) :]}",
                              path=root, hint=PRIVATE_HINT)  # fmt: skip


def why_off(errors: list[str], nodes: list[str] | None, *, can_group: bool) -> str | None:
    """Why tier 0 cannot be on (``None``: it can): a rank could not create its directory or
    refused it (``errors``), the ranks' views disagree (``nodes`` ``None``), no group for
    the peer copy, or uneven nodes."""
    refused = [e for e in errors if e.startswith(REFUSED)]
    if refused:
        return f"{refused[0]} (never followed, nothing written there)"
    if errors:
        return f"cannot create it ({errors[0]})"
    if nodes is None:
        return "the ranks' views of it disagree (some rank sees another's probe file, which does not see its)"
    counts = {n: nodes.count(n) for n in nodes}
    if len(counts) > 1 and not can_group:
        return f"the ranks see {len(counts)} separate directories and no process group is there for the peer copy"
    if len(set(counts.values())) > 1:
        return f"the peer copy needs as many ranks on every node; here {sorted(counts.values())}"
    return None


def off_hint(errors: list[str], nodes: list[str] | None) -> str:
    """What to do about :func:`why_off`'s reason."""
    if any(e.startswith(REFUSED) for e in errors):
        return PRIVATE_HINT
    if errors or nodes is None:
        return MEMORY_HINT
    return ("Tier 0 restores a lost node's share from the next node, which holds its own share and one peer's; "
            "with uneven nodes some node would hold more than that. Run the same number of ranks per node.")  # fmt: skip
