"""Unpickling what storage hands us without running code from it (docs/security.md).

State files load with ``torch.load(weights_only=True)`` and an allow-list scoped to that one
call (never ``add_safe_globals``); anything else raises :class:`UntrustedCheckpointError`
naming the opt-in. DCP's ``.metadata`` goes through :func:`unpickle_dcp_metadata`.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format import TensorDict, TensorRef, tensor_from_bytes
from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import DCP_METADATA_NAME
from lightning_preempt.format.pickles.fast_unpickle import OffFastPath, fast_load_state, numpy_globals
from lightning_preempt.format.pickles.metadata_scan import check_dcp_structure, unpickle_metadata
from lightning_preempt.format.pickles.state_replay import corrupt_state_error, untrusted_state_error
from lightning_preempt.format.skeleton import map_leaves
from lightning_preempt.storage.store import Store

#: ``.metadata`` larger than this is refused unread when the manifest does not bound it.
MAX_METADATA_BYTES = 256 << 20

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


# ---- the per-rank state files -------------------------------------------------------------
#: what the skeleton's own pickles name (format/__init__.py)
_OURS = (TensorRef, TensorDict, tensor_from_bytes)


def skeleton_safe_globals() -> list[Any]:
    """On top of ``weights_only``'s defaults: the placeholders, inline tensors and NumPy
    (RNG states); all a ``Trainer.fit`` puts there (Lightning 2.6)."""
    return [*_OURS, *numpy_globals()]


def load_state_bytes(data: bytes, *, path: str, trusted: bool = False, map_location: Any = None) -> Any:
    """Unpickle one state file; ``trusted``: full unpickling (the user opted in)."""
    state = _load_state(data, path=path, trusted=trusted, map_location=map_location)
    if map_location is not None and _INLINE in data:  # inline tensors are made on the CPU
        state = apply_map_location(state, map_location)
    return state


#: how a state file names an inline tensor's constructor (protocol 2: ``GLOBAL module name``)
_INLINE = f"{tensor_from_bytes.__module__}\n{tensor_from_bytes.__qualname__}".encode()


def _load_state(data: bytes, *, path: str, trusted: bool, map_location: Any) -> Any:
    location = map_location if map_location is not None else "cpu"
    if trusted:
        return torch.load(io.BytesIO(data), map_location=location, weights_only=False)
    try:
        return fast_load_state(data, location)  # the common case, ~10x faster (format/pickles/fast_unpickle.py)
    except OffFastPath:
        pass  # weights_only decides (it allows a superset) and words any error
    # NumPy's globals only when the bytes name them: weights_only rebuilds the allowed dict
    # per object, so a shorter list is faster (and never less safe)
    allowed: list[Any] = skeleton_safe_globals() if b"numpy" in data else list(_OURS)
    try:
        with torch.serialization.safe_globals(allowed):  # scoped to this call
            return torch.load(io.BytesIO(data), map_location=location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise untrusted_state_error(_unsupported_global(err), _refusal(err), path) from None
    except (RuntimeError, ValueError, TypeError, IndexError, EOFError, KeyError, OSError) as err:
        # (TypeError, IndexError: a hand-made pickle that BUILDs a tensor with a bad state,
        # or pops more than it pushed, inside torch's weights-only unpickler)
        first = str(err).splitlines()[0] if str(err) else ""
        raise corrupt_state_error(f"{type(err).__name__}: {first}", path) from err


def _unsupported_global(err: BaseException) -> str | None:
    match = _GLOBAL_RE.search(str(err))
    if match is None:
        return None
    name = match.group(1)
    return name if "." in name else f"builtins.{name}"  # torch names builtins without their module


def _refusal(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines()]
    after = lines[lines.index("WeightsUnpickler error:") + 1 :] if "WeightsUnpickler error:" in lines else lines
    detail = next((line for line in after if line and not line.startswith(("Weights only", "Please file"))), "")
    return detail or type(err).__name__


# ---- DCP's .metadata ----------------------------------------------------------------------
def _metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _compat.torch_get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _compat.DcpStorageInfo,
    }
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(metadata, name):  # every one exists in torch 2.7-2.13
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    return allowed


def unpickle_dcp_metadata(data: bytes, *, path: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata`` bytes, through the restricted unpickler: DCP's
    metadata classes, ``torch.Size``, dtypes and layouts; nothing else."""
    allowed = _metadata_classes()

    def resolve(module: str, name: str) -> Any:
        found = allowed.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return found

    return unpickle_metadata(data, path, resolve)


def dcp_metadata(data: bytes, *, path: str, manifest: Manifest | None) -> Any:
    """:func:`unpickle_dcp_metadata`, checked to describe only tensors in byte ranges of the
    manifest's shard files (docs/security.md)."""
    metadata = unpickle_dcp_metadata(data, path=path)
    check_dcp_structure(metadata, path=path, manifest=manifest)
    return metadata


def read_dcp_metadata(store: Store, manifest: Manifest | None = None) -> Any:
    """Read, unpickle (restricted) and check the ``.metadata`` of the checkpoint in ``store``."""
    entry = manifest.files.get(DCP_METADATA_NAME) if manifest is not None else None
    limit = entry.size if entry is not None else MAX_METADATA_BYTES
    try:
        data = store.read_bytes(DCP_METADATA_NAME, limit)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(
            "file '.metadata' listed in the manifest is missing",
            path=store.url,
            hint="This checkpoint is damaged; resume from an older one (auto-resume skips it).",
        ) from err
    return dcp_metadata(data, path=store.url, manifest=manifest)


# ---- map_location -------------------------------------------------------------------------
def apply_map_location(obj: Any, map_location: Any) -> Any:
    """Move every tensor in ``obj`` (dicts, lists, tuples) where ``map_location`` (as
    ``torch.load`` takes it: device, str, dict or callable) sends a CPU storage."""
    if map_location is None:
        return obj
    device = _target_device(map_location)
    if device is None or device.type == "cpu":
        return obj
    return _map_tensors(obj, lambda t: t.to(device))


def _target_device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return torch.device(target) if target is not None else None
    if callable(map_location):
        probe = map_location(torch.UntypedStorage(0), "cpu")
        return probe.device if probe is not None else None
    return None


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor, containers kept as their exact types."""
    return map_leaves(obj, lambda leaf, _: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf)
