"""Peer replica: every rank's share of a committed node-local checkpoint also on another node
(docs/peer-replica.md): each rank sends its files to its *buddy* on the next node (a ring),
which checks them against the manifest and commits them in its own local tier. Collective:
every rank of ``group`` calls :func:`replicate` with the same checkpoint. No Lightning here."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError, CorruptCheckpointError
from lightning_preempt.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from lightning_preempt.format.names import MANIFEST_NAME, dir_step, is_checkpoint_file, writer_of
from lightning_preempt.read.verify import check_regular
from lightning_preempt.storage import local
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import CHUNK_BYTES, Store
from lightning_preempt.tiers.drain import copy_files

log = logging.getLogger(__name__)

#: Bound of the small JSON values ranks exchange here (node ids, file lists, error texts):
#: the file names of one rank's share of even a 100k-file manifest stay far below it.
WIRE_MAX_BYTES = 8 << 20
#: Bound of one rank's holdings (its local tier's checkpoints newer than the bucket's, each
#: with its manifest's text): a few manifests, each capped at MAX_MANIFEST_BYTES.
_HOLDINGS_MAX_BYTES = 4 * MAX_MANIFEST_BYTES


class ReplicaError(CheckpointError):
    """The peer replica of a checkpoint could not be made."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which node each rank is on and which rank keeps a copy of its files."""

    node_of: list[str]
    buddy: list[int | None]  # None: a single node, no other node to hold a copy


def node_id() -> str:
    """This process's node: torchrun's ``GROUP_RANK`` (one agent per node), else the host name."""
    group_rank = os.environ.get("GROUP_RANK")
    torchrun = group_rank is not None and "TORCHELASTIC_RUN_ID" in os.environ
    return f"node{group_rank}" if torchrun else socket.gethostname()


def placement(node_of: list[str]) -> Placement:
    """Rank r's buddy: the rank at r's position on the next node (ring over the nodes in
    order of first appearance), so a copy never sits on its original's node."""
    nodes = list(dict.fromkeys(node_of))
    members = {n: [r for r, m in enumerate(node_of) if m == n] for n in nodes}
    buddy: list[int | None] = [None] * len(node_of)
    for r, n in enumerate(node_of if len(nodes) > 1 else []):
        nxt = members[nodes[(nodes.index(n) + 1) % len(nodes)]]
        buddy[r] = nxt[members[n].index(r) % len(nxt)]
    return Placement(node_of=list(node_of), buddy=buddy)


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What one rank did: bytes it sent and received, and where every file lives now."""

    step: int
    bytes_sent: int
    bytes_received: int
    files_received: list[str]
    holders: dict[str, list[str]]  # file name -> nodes whose local tier holds it
    seconds: float


def _read_manifest(local_dir: str) -> bytes | None:
    """The manifest in ``local_dir`` (a regular file, not through a symlink, size-capped:
    :meth:`Store.read_bytes`), or ``None`` when there is none."""
    try:
        return Store(local_dir).read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None


def write_durable(path: str, data: bytes | memoryview) -> None:
    # Temporary names retention recognises as ours (ownership.py), unique per writer: two
    # ranks of one node may write the same manifest into their shared local tier.
    base = os.path.basename(path)
    tag = uuid.uuid4().hex
    local.write_atomic(path, data, tmp_name=f".{base}.{tag}.tmp" if base == MANIFEST_NAME else f".replica-{tag}.distcp")


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(off, min(CHUNK_BYTES, size - off)) for off in range(0, size, CHUNK_BYTES)] or [(0, 0)]


def replicate(local_dir: str, group: dist.ProcessGroup | None, *, node: str | None = None) -> ReplicaReport:
    """Copy every rank's files of the checkpoint in ``local_dir`` to its buddy's local tier.

    ``local_dir`` is this rank's path of one committed checkpoint (rank 0 holds its
    ``manifest.json``). Collective over ``group``; a failure on any rank raises
    :class:`ReplicaError` on every rank (the transfer is agreed, never half-assumed).
    ``node``: this rank's node for the placement (default :func:`node_id`; tier 0 passes
    the ranks that share its directory, tiers/tier0_peer.py). The local tier is untrusted
    input like any storage: what is checked, and when (docs/peer-replica.md, "Transfer").
    """
    start = time.monotonic()
    me, world = pdist.rank(group), pdist.world_size(group)
    raw = _agreed_manifest(local_dir, group)
    manifest = parse_manifest(raw, path=local_dir)  # every rank: the strict schema, before any write
    # A rank sends the files it wrote (several ranks of one node may share a local tier). An
    # entry of any kind counts as present: a symlink or FIFO in a shard's place is refused
    # below, loudly, never skipped (the peer would commit a checkpoint missing a file).
    present = {e.name for e in Store(local_dir).entries()}
    own = sorted(n for n in manifest.files if writer_of(n) == me and n in present)
    data: dict[str, bytes] = {}
    err: str | None = None
    try:
        data = read_own(Store(local_dir), manifest, own)
    except (OSError, CheckpointError) as exc:
        err = f"{type(exc).__name__}: {exc}"
    shares = pdist.all_gather_json({"node": node or node_id(), "own": own, "error": err}, group, max_bytes=WIRE_MAX_BYTES)
    raise_failed([s["error"] for s in shares], f"the peer replica of step {manifest.step}", local_dir,
                  f"Nothing was sent; {_STAYS}")  # fmt: skip
    where = placement([str(s["node"]) for s in shares])
    held: list[list[str]] = [[n for n in s["own"] if n in manifest.files] for s in shares]
    claimed: set[str] = set()  # a file two ranks of one node hold (a shared local tier) is sent once
    plan: list[tuple[int, int, str]] = []  # (sender, buddy, file) in one order, identical on every rank
    for sender in range(world):
        buddy = where.buddy[sender]
        for name in held[sender]:
            key = f"{where.node_of[sender]}/{name}"
            if buddy is not None and key not in claimed:
                claimed.add(key)
                plan.append((sender, buddy, name))
    sent, received, err = transfer(local_dir, manifest, data, plan, me, group)
    errors = pdist.all_gather_json(err, group, max_bytes=WIRE_MAX_BYTES)
    raise_failed(errors, f"the peer replica of step {manifest.step}", local_dir, _STAYS)
    if me != 0 and received:
        write_durable(os.path.join(local_dir, MANIFEST_NAME), raw)  # last: the files are durable
    holders = {name: {where.node_of[sender]} for sender in range(world) for name in held[sender]}
    for _, buddy, name in plan:
        holders[name].add(where.node_of[buddy])
    return ReplicaReport(
        step=manifest.step,
        bytes_sent=sent,
        bytes_received=sum(manifest.files[n].size for n in received),
        files_received=received,
        holders={n: sorted(v) for n, v in holders.items()},
        seconds=time.monotonic() - start,
    )


def _agreed_manifest(local_dir: str, group: dist.ProcessGroup | None) -> bytes:
    """Rank 0's manifest bytes on every rank: read and validated on rank 0 (the outcome
    agreed as JSON), then sent as the bytes themselves, length first, at most
    :data:`MAX_MANIFEST_BYTES`."""
    raw: bytes | None = None

    def load() -> bool:
        nonlocal raw
        raw = _read_manifest(local_dir)
        if raw is not None:
            parse_manifest(raw, path=local_dir)  # refused on rank 0 before a byte is sent
        return raw is not None

    found = agree.decide(load, group, what="reading the checkpoint's manifest", json_max_bytes=WIRE_MAX_BYTES)
    if not found:
        raise ReplicaError("rank 0 holds no manifest for this checkpoint", path=local_dir,
                           hint="Replicate only a checkpoint that committed on the local tier.")  # fmt: skip
    return pdist.broadcast_bytes(raw, group, max_bytes=MAX_MANIFEST_BYTES)


def read_own(store: Store, manifest: Manifest, names: list[str]) -> dict[str, bytes]:
    """Each of ``names`` as the drain and the loader read it: a regular file, not through a
    symlink, of exactly its manifest size (``check_regular`` before opening, then
    :meth:`Store.read_bytes` capped at that size: a FIFO never blocks, a file grown since
    is never read whole)."""
    out: dict[str, bytes] = {}
    for name in names:
        size = manifest.files[name].size
        check_regular(store, name, size)
        data = store.read_bytes(name, size)
        if len(data) != size:
            raise CorruptCheckpointError(f"file {name!r} has {len(data)} bytes, the manifest says {size}",
                                         path=store.url, hint="The local copy changed after the commit; "
                                         "the drain to the bucket is the copy to trust.")  # fmt: skip
        out[name] = data
    return out


_STAYS = (
    "The checkpoint stays committed where it was; only the copy on a peer node is missing. Check the "
    "local tier's files and free space."
)


def raise_failed(errors: list[object], what: str, path: str, hint: str) -> None:
    """Raise :class:`ReplicaError` on every rank when any rank reported an error."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise ReplicaError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}", path=path, hint=hint)


def transfer(
    local_dir: str,
    manifest: Manifest,
    data: dict[str, bytes],
    plan: list[tuple[int, int, str]],
    me: int,
    group: dist.ProcessGroup | None,
) -> tuple[int, list[str], str | None]:
    """Post every send and receive of ``plan`` (``(sender, receiver, file)``, the same list
    on every rank; a receiver gets a file once) at once, so pairs run in parallel; wait,
    then verify each received file's size and CRC32C against ``manifest`` and write it
    durably into ``local_dir`` (never the manifest: the caller commits it, last).
    ``data``: this rank's files to send, read already. Returns (bytes sent, files
    received, error)."""
    ops: list[dist.P2POp] = []
    incoming: dict[str, list[torch.Tensor]] = {}
    sent = 0
    for sender, buddy, name in plan:
        size = manifest.files[name].size
        if me == sender:
            tensor = torch.frombuffer(bytearray(data[name]) or bytearray(1), dtype=torch.uint8)
            for off, n in _chunks(size):
                ops.append(dist.P2POp(dist.isend, tensor[off : off + max(n, 1)], buddy, group))
            sent += size
        elif me == buddy:
            bufs = [torch.empty(max(n, 1), dtype=torch.uint8) for _, n in _chunks(size)]
            incoming[name] = bufs
            ops.extend(dist.P2POp(dist.irecv, b, sender, group) for b in bufs)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    try:
        for name, bufs in incoming.items():
            entry = manifest.files[name]
            got = b"".join(b.numpy().tobytes() for b in bufs)[: entry.size]
            crc = Crc32c()
            crc.update(got)
            if len(got) != entry.size or crc.hexdigest() != entry.crc32c:
                return sent, [], f"{name} arrived damaged (size {len(got)}, crc {crc.hexdigest()} != {entry.crc32c})"
            os.makedirs(local_dir, exist_ok=True)
            write_durable(os.path.join(local_dir, name), got)
    except OSError as err:
        return sent, [], f"{type(err).__name__}: {err}"
    return sent, sorted(incoming), None


def gather_holdings(local_root: str, floor: int, group: dist.ProcessGroup | None) -> list[dict[str, dict[str, Any]]]:
    """Every rank's holdings under ``local_root`` (checkpoints newer than ``floor``), on every
    rank, as :func:`plan_union` takes them (each manifest as bytes, or ``None``). Collective.

    Each rank sends, as JSON values, for each of our checkpoint dirs newer than ``floor``, the
    manifest's text (if here and valid) and the sizes of the checkpoint files here (regular
    files only: a symlink or FIFO is held by nobody)."""
    mine: dict[str, dict[str, object]] = {}
    root = Store(local_root)
    for entry in root.entries():
        step = dir_step(entry.name)
        if step is None or step <= floor or entry.kind != "dir":
            continue
        ckpt = root.child(entry.name)
        files = {e.name: e.size for e in ckpt.entries() if e.kind == "file" and is_checkpoint_file(e.name)}
        try:
            raw = _read_manifest(ckpt.path())
            manifest = None if raw is None else raw.decode("utf-8")
            if raw is not None:
                parse_manifest(raw, path=ckpt.url)  # validated before it is sent (UTF-8 then too)
        except (CheckpointError, UnicodeDecodeError):  # not a regular file, too large, damaged: untrusted
            manifest = None
        mine[entry.name] = {"step": step, "manifest": manifest, "files": files}
    gathered = pdist.all_gather_json(mine, group, max_bytes=_HOLDINGS_MAX_BYTES)
    for holding in gathered:  # the manifests travelled as JSON text; plan_union takes their bytes
        for held in holding.values():
            held["manifest"] = held["manifest"].encode("utf-8") if isinstance(held["manifest"], str) else None
    return gathered  # type: ignore[no-any-return]


def plan_union(holdings: list[dict[str, dict[str, object]]]) -> tuple[str, bytes, dict[str, int]] | None:
    """The newest checkpoint whose files the ranks hold *together* (sizes as in its
    manifest): ``(dir name, manifest bytes, {file: the lowest rank that holds it})``.
    Pure: every rank computes the same plan from the same gathered holdings."""
    names = sorted({n for h in holdings for n in h}, key=lambda n: -int(dir_step(n) or -1))
    for name in names:
        raw = next((h[name]["manifest"] for h in holdings if name in h and h[name]["manifest"]), None)
        if not isinstance(raw, bytes):
            continue  # no rank holds its manifest: it was never committed
        try:
            manifest = parse_manifest(raw, path=name)
        except CheckpointError:
            continue
        assignment: dict[str, int] = {}
        for file, entry in manifest.files.items():
            holders = [r for r, h in enumerate(holdings) if name in h and h[name]["files"].get(file) == entry.size]  # type: ignore[attr-defined]
            if not holders:
                break
            assignment[file] = holders[0]
        else:
            return name, raw, assignment
    return None


def complete_from_peers(
    local_root: str, remote_url: str, remote_options: dict[str, Any], group: dist.ProcessGroup | None
) -> int | None:
    """Upload to ``remote_url`` the newest checkpoint that is in no single local tier but in
    the ranks' local tiers together (the peer replica's copies included); returns its step.

    For a restart after a node left (more than two nodes: no survivor holds every file).
    Each file is uploaded by the lowest rank that holds it; rank 0 commits the manifest
    last, create-only, after every rank's uploads landed. Collective over ``group``.
    """
    remote = Store(remote_url, remote_options)

    def remote_floor() -> int:
        return max((c.step for c in list_checkpoints(remote_url, remote_options) if c.committed), default=-1)

    floor = agree.decide(remote_floor, group, what="listing the remote tier", json_max_bytes=WIRE_MAX_BYTES)
    plan = plan_union(gather_holdings(local_root, floor, group))
    if plan is None:
        return None
    name, raw, assignment = plan
    manifest = parse_manifest(raw, path=name)
    me = pdist.rank(group)
    src, dst = Store(os.path.join(local_root, name)), remote.child(name)
    mine = [f for f, r in assignment.items() if r == me]
    err: str | None = None
    try:
        dst.makedirs()
        copy_files(src, dst, manifest, names=mine)
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
    raise_failed(pdist.all_gather_json(err, group, max_bytes=WIRE_MAX_BYTES), f"uploading {name} from the survivors",
                  dst.url, "Nothing was committed there; the local copies stay.")  # fmt: skip
    agree.decide(lambda: dst.commit_bytes(MANIFEST_NAME, raw), group, what="committing the survivors' upload",
                 json_max_bytes=WIRE_MAX_BYTES)  # fmt: skip
    log.warning("lightning_preempt: %s (step %d) completed in %s from the survivors' local tiers",
                name, manifest.step, remote_url)  # fmt: skip
    return manifest.step
