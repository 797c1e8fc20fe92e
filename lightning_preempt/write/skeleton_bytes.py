"""The skeleton's ``torch.save`` archive, without a Python call per pickled object.

``torch.save`` pickles with a subclass of ``pickle_module.Pickler`` whose
``persistent_id`` (a Python method) the C pickler calls for *every* object, to find tensor
storages. A skeleton of 4000 placeholders is ~26000 objects: ~25 ms of the time training
waits, for a skeleton that usually holds no storage at all (its tensors went to the shards).

:func:`skeleton_bytes` passes ``torch.save`` a ``pickle_module`` whose ``Pickler`` first
pickles with a plain C pickler that has no ``persistent_id``, only a ``reducer_override``
(called for objects that are not of a builtin type: the placeholders, never the strings,
ints and dicts) that gives up at the first tensor or storage. Without one, ``persistent_id``
would have returned ``None`` for every object: the bytes are the same. With one (a tensor
kept outside the sharded keys, e.g. an RNG state), the data written so far is discarded and
the object pickled again with torch's ``persistent_id``, as ``torch.save`` does.
Either way the archive is ``torch.save``'s: torch writes the records, the storages and the
zip. Checked against ``torch.save`` byte for byte by tests/unit/test_skeleton_bytes.py.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import IO, Any

import torch

from lightning_preempt.format import TensorRef


class _HoldsStorage(Exception):
    """The object holds a tensor or storage: ``persistent_id`` is needed."""


class _PlainPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorRef:  # what its __reduce__ returns, without calling it
            return (TensorRef, (obj.key,))
        if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage)) or torch.is_storage(obj):
            raise _HoldsStorage
        return NotImplemented


class _Pickler:
    """What ``torch.save`` subclasses as ``pickle_module.Pickler`` (it adds, or assigns,
    ``persistent_id``) and calls ``dump`` on once."""

    persistent_id: Any = None

    def __init__(self, file: IO[bytes], protocol: int | None = None) -> None:
        self._file = file
        self._protocol = protocol

    def dump(self, obj: Any) -> None:
        start = self._file.tell()
        try:
            _PlainPickler(self._file, self._protocol).dump(obj)
            return
        except _HoldsStorage:
            self._file.seek(start)
            self._file.truncate()
        find = self.persistent_id

        class _TorchPickler(pickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                return find(obj) if find is not None else None

        _TorchPickler(self._file, self._protocol).dump(obj)


#: passed to ``torch.save`` as its ``pickle_module`` (it reads ``__name__`` and ``Pickler``)
_PICKLE_MODULE = types.SimpleNamespace(__name__="lightning_preempt.write.skeleton_bytes", Pickler=_Pickler,
                                       dump=pickle.dump, dumps=pickle.dumps)  # fmt: skip


def skeleton_bytes(skeleton: Any) -> bytes:
    """``torch.save(skeleton)``'s bytes (see the module docstring)."""
    buffer = io.BytesIO()
    torch.save(skeleton, buffer, pickle_module=_PICKLE_MODULE)
    return buffer.getvalue()
