"""The skeleton's ``torch.save`` archive, without a Python call per pickled object.

``torch.save``'s ``persistent_id`` runs for *every* pickled object (~25 ms for 4000
placeholders), so a plain C pickler goes first: small, dense CPU tensors are pickled inline as
``lightning_preempt.format.tensor_from_bytes(...)``; any other tensor or storage gives up, and
the object is pickled again as ``torch.save`` does. The archive is ``torch.save``'s either way."""

from __future__ import annotations

import io
import pickle
import types
from typing import IO, Any

import torch

from lightning_preempt.format import INLINE_TENSOR_DTYPES, INLINE_TENSOR_MAX_BYTES, TensorRef, tensor_from_bytes


class _HoldsStorage(Exception):
    """The object holds a tensor or storage: ``persistent_id`` is needed."""


class _PlainPickler(pickle.Pickler):
    def __init__(self, file: IO[bytes], protocol: int | None) -> None:
        super().__init__(file, protocol)
        self._storages: set[int] = set()  # of the inline tensors: a second tensor on one gives up

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorRef:  # what its __reduce__ returns, without calling it
            return (TensorRef, (obj.key,))
        if type(obj) is torch.Tensor:
            return self._inline(obj)
        if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage)) or torch.is_storage(obj):
            raise _HoldsStorage
        return NotImplemented

    def _inline(self, t: torch.Tensor) -> Any:
        """``tensor_from_bytes``'s reduction of a plain tensor that owns its whole storage,
        or :class:`_HoldsStorage` (the same object twice is pickled once: the memo)."""
        nbytes = t.numel() * t.element_size()
        if not (
            t.device.type == "cpu"
            and t.layout == torch.strided
            and not t.requires_grad
            and nbytes <= INLINE_TENSOR_MAX_BYTES
            and str(t.dtype).removeprefix("torch.") in INLINE_TENSOR_DTYPES
            and t.storage_offset() == 0
            and t.is_contiguous()
            and not (t.is_conj() or t.is_neg())
            and not t.__dict__  # attributes torch.save would keep
        ):
            raise _HoldsStorage
        storage = t.untyped_storage()
        if storage.nbytes() != nbytes or storage.data_ptr() in self._storages:
            raise _HoldsStorage  # part of a larger storage, or shared with another tensor
        if nbytes:
            self._storages.add(storage.data_ptr())
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes().decode("latin-1") if nbytes else ""
        return (tensor_from_bytes, (str(t.dtype).removeprefix("torch."), tuple(t.shape), data))


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
    """``torch.save(skeleton)``'s archive, small tensors inline (see the module docstring)."""
    buffer = io.BytesIO()
    torch.save(skeleton, buffer, pickle_module=_PICKLE_MODULE)
    return buffer.getvalue()
