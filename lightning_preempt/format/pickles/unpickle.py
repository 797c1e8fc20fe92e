"""Unpickling what storage hands us without running code from it (docs/security.md).

State files load with ``torch.load(weights_only=True)`` and an allow-list scoped to that one
call (never ``add_safe_globals``); anything else raises :class:`UntrustedCheckpointError`
naming the opt-in. DCP's ``.metadata`` goes through :class:`_MetadataUnpickler`.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_preempt.format import TensorRef, tensor_from_bytes
from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.containers import map_leaves
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import DCP_METADATA_NAME
from lightning_preempt.format.pickles.fast_unpickle import OffFastPath, fast_load_state, numpy_globals
from lightning_preempt.format.pickles.metadata_scan import check_dcp_structure
from lightning_preempt.storage.store import Store

TRUST_HINT = (
    "Load it only if you trust everyone who can write this storage: pass "
    "ShardedAsyncCheckpointIO(trust_checkpoints=True) (or Trainer.fit(..., weights_only=False) for one load, "
    "`lightning-preempt export --trust` on the command line). Better: keep plain types (dict, list, str, "
    "numbers, tensors, NumPy arrays) in on_save_checkpoint / hyper-parameters. See docs/security.md."
)
#: ``.metadata`` larger than this is refused unread when the manifest does not bound it.
MAX_METADATA_BYTES = 256 << 20

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


# ---- the per-rank state files -------------------------------------------------------------
def skeleton_safe_globals() -> list[Any]:
    """On top of ``weights_only``'s defaults: :class:`TensorRef`, inline tensors and NumPy
    (RNG states); all a ``Trainer.fit`` puts there (Lightning 2.6)."""
    return [TensorRef, tensor_from_bytes, *numpy_globals()]


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
    allowed: list[Any] = skeleton_safe_globals() if b"numpy" in data else [TensorRef, tensor_from_bytes]
    try:
        with torch.serialization.safe_globals(allowed):  # scoped to this call
            return torch.load(io.BytesIO(data), map_location=location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _untrusted(err, _unsupported_global(err), path) from None
    except (RuntimeError, ValueError, TypeError, IndexError, EOFError, KeyError, OSError) as err:
        # (TypeError, IndexError: a hand-made pickle that BUILDs a tensor with a bad state,
        # or pops more than it pushed, inside torch's weights-only unpickler)
        raise CorruptCheckpointError(
            f"the per-rank state is not a readable torch.save file ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})",
            path=path,
            hint="The checkpoint is damaged or was not written by lightning_preempt; resume from an older one.",
        ) from err


def _unsupported_global(err: BaseException) -> str | None:
    match = _GLOBAL_RE.search(str(err))
    if match is None:
        return None
    name = match.group(1)
    return name if "." in name else f"builtins.{name}"  # torch names builtins without their module


def _untrusted(err: BaseException, name: str | None, path: str) -> UntrustedCheckpointError:
    if name is not None:
        what = f"needs the global {name}, which is not on the allow-list of what lightning_preempt writes"
    else:
        lines = [line.strip() for line in str(err).splitlines()]
        after = lines[lines.index("WeightsUnpickler error:") + 1 :] if "WeightsUnpickler error:" in lines else lines
        detail = next((line for line in after if line and not line.startswith(("Weights only", "Please file"))), "")
        what = f"uses something weights_only loading refuses ({detail or type(err).__name__})"
    return UntrustedCheckpointError(
        f"refusing to unpickle the checkpoint state: it {what}; unpickling it could run code",
        global_name=name,
        path=path,
        hint=TRUST_HINT,
    )


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


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes, ``torch.Size``, dtypes and layouts; nothing else."""

    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any], path: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "BytesStorageMetadata":
            raise CorruptCheckpointError(
                "DCP metadata declares byte-IO (pickled object) items; lightning_preempt writes tensors only",
                path=self._path,
                hint="This checkpoint was not written by lightning_preempt or was tampered with; do not load it.",
            )
        raise UntrustedCheckpointError(
            f"refusing to unpickle DCP's .metadata: it needs the global {module}.{name}, not one of DCP's "
            "metadata classes; unpickling it could run code",
            global_name=f"{module}.{name}",
            path=self._path,
            hint="lightning_preempt never writes that: the checkpoint was tampered with or written by something "
            "else. trust_checkpoints does not cover DCP metadata; delete the checkpoint (docs/security.md).",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError("DCP metadata uses persistent ids", path=self._path)


def unpickle_dcp_metadata(data: bytes, *, path: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata`` bytes, through the restricted unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), _metadata_classes(), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated, garbage, wrong argument types for an allowed class…
        raise CorruptCheckpointError(
            f"DCP's .metadata cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
            path=path,
            hint="The checkpoint is damaged; resume from an older one.",
        ) from err
    return metadata


def read_dcp_metadata(store: Store, manifest: Manifest | None = None) -> Any:
    """Read, unpickle (restricted) and check the ``.metadata`` of the checkpoint in ``store``."""
    entry = manifest.files.get(DCP_METADATA_NAME) if manifest is not None else None
    limit = entry.size if entry is not None else MAX_METADATA_BYTES
    try:
        data = store.read_regular(DCP_METADATA_NAME, limit)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(
            "file '.metadata' listed in the manifest is missing",
            path=store.url,
            hint="This checkpoint is damaged; resume from an older one (auto-resume skips it).",
        ) from err
    metadata = unpickle_dcp_metadata(data, path=store.url)
    check_dcp_structure(metadata, path=store.url, manifest=manifest)
    return metadata


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
