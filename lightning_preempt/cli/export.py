"""Export a sharded checkpoint directory as one plain Lightning ``.ckpt`` (``torch.save``).

Plain Lightning loads it without this package; a pickle naming a ``lightning_preempt``
class is refused before it gets its name. NumPy values in our own entry become plain
Python ones, so Lightning >= 2.6's ``weights_only=True`` load accepts it
(:attr:`ExportResult.weights_only_error` says when other keys still need ``False``).
"""

from __future__ import annotations

import dataclasses
import os
import pickletools
import zipfile
from typing import Any

import torch

from lightning_preempt.errors import CheckpointError, CheckpointExistsError
from lightning_preempt.format.pickles.unpickle import _map_tensors
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.storage.local import write_atomic
from lightning_preempt.storage.store import Store

_OUR_PACKAGE = "lightning_preempt"
OWN_STATE_KEY = "lightning_preempt"  # the top-level checkpoint key this package's callback fills


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    path: str
    checkpoint: dict[str, Any]
    size_bytes: int
    weights_only_error: str | None = None  # why torch.load(weights_only=True) fails, if it does


class ExportError(CheckpointError):
    """The checkpoint cannot be exported as a self-contained Lightning file."""


def export_checkpoint(
    store: Store, out_path: str, *, force: bool = False, verify: bool = True, trusted: bool = False
) -> ExportResult:
    """Write the checkpoint in ``store`` to the local file ``out_path`` atomically; state is
    unpickled with the allow-list only unless ``trusted``. :class:`CheckpointExistsError`
    when ``out_path`` exists and not ``force``."""
    out_path = os.path.abspath(os.path.expanduser(out_path))
    if os.path.isdir(out_path):
        raise ExportError(
            f"the output path {out_path} is a directory",
            hint="Name the file to write, e.g. OUT_DIR/model.ckpt.",
        )
    if os.path.exists(out_path) and not force:
        raise CheckpointExistsError(
            f"refusing to overwrite the existing file {out_path}",
            hint="Choose another name, or pass --force to replace it.",
        )
    checkpoint = _own_storage(load_full_checkpoint(store, verify=verify, trusted=trusted))
    if OWN_STATE_KEY in checkpoint:
        checkpoint[OWN_STATE_KEY] = plain_numpy(checkpoint[OWN_STATE_KEY])
    directory = os.path.dirname(out_path)
    os.makedirs(directory, exist_ok=True)
    found: dict[str, str | None] = {}

    def check(tmp: str) -> None:  # the durable temp file, before it gets its name
        foreign = sorted(g for g in pickled_globals(tmp) if g.split(".")[0] == _OUR_PACKAGE)
        if foreign:
            raise ExportError(
                f"the checkpoint state refers to {', '.join(foreign)}, which plain Lightning cannot load",
                path=store.url,
                hint="A callback or the module stores an object of lightning_preempt in its state; "
                "store plain types (dict, list, str, numbers, tensors) there instead.",
            )
        found["weights_only_error"] = weights_only_problem(tmp)

    try:
        # create-only unless forced: never replace a file that appeared meanwhile unchecked
        write_atomic(out_path, lambda f: torch.save(checkpoint, f), exclusive=not force, check=check)
    except FileExistsError:
        raise CheckpointExistsError(
            f"refusing to overwrite the existing file {out_path}", hint="Pass --force to replace it."
        ) from None
    return ExportResult(out_path, checkpoint, os.path.getsize(out_path), found["weights_only_error"])


def _own_storage(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Tensors that view a larger buffer (the one-pass loader reads each archive into one)
    get storage of their own: ``torch.save`` writes a tensor's whole storage, and a
    storage of odd byte size under another dtype does not load back."""

    def own(t: torch.Tensor) -> torch.Tensor:
        exact = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        return t if exact else t.clone(memory_format=torch.contiguous_format)

    result = _map_tensors(checkpoint, own)
    assert isinstance(result, dict)
    return result


def plain_numpy(value: Any) -> Any:
    """``value`` with NumPy arrays and scalars (at any depth of dicts, lists and tuples)
    turned into Python lists and numbers."""
    module = type(value).__module__
    if module == "numpy" or module.startswith("numpy."):
        return value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, dict):
        items = {k: plain_numpy(v) for k, v in value.items()}
        try:
            return items if type(value) is dict else type(value)(items)
        except TypeError:
            return items
    if isinstance(value, list):
        return [plain_numpy(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain_numpy(v) for v in value)
    return value


def weights_only_problem(path: str) -> str | None:
    """``None`` when ``torch.load(path, weights_only=True)`` works, else the first line of its error."""
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        lines = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
        return lines[0] if lines else str(err).splitlines()[0]
    return None


# ---- which globals a pickle imports (whether it would load is format/pickles/check.py's question)
def pickled_globals(path: str) -> set[str]:
    """Every ``module.qualname`` the pickle inside the ``torch.save`` file at ``path`` imports."""
    with zipfile.ZipFile(path) as archive:
        found = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        data = archive.read(found[0])
    return pickle_globals(data)


def pickle_globals(data: bytes) -> set[str]:
    """Every ``module.qualname`` a pickle imports (``GLOBAL`` and ``STACK_GLOBAL``)."""
    found: set[str] = set()
    memo: dict[Any, Any] = {}
    recent: list[Any] = []  # what each op pushed, as far as strings go
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            module, qualname = str(arg).split(" ", 1)
            found.add(f"{module}.{qualname}")
            recent.append(None)
        elif name == "STACK_GLOBAL":
            if len(recent) >= 2 and isinstance(recent[-2], str) and isinstance(recent[-1], str):
                found.add(f"{recent[-2]}.{recent[-1]}")
            else:
                found.add("<unknown>.<unknown>")
            recent.append(None)
        elif "UNICODE" in name or "STRING" in name:
            recent.append(arg)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = recent[-1] if recent else None
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(arg))
        else:
            recent.append(None)
    return found
