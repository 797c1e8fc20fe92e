"""DCP tensor records written without a ``torch.save`` call per tensor: per (dtype, shape), a
template cut from ``torch.save``'s own archive around the data record, checked before use
(docs/design.md, "The writer's fast paths"); the bytes are a valid ``torch.save`` archive."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import IO, Any, cast

import torch

from lightning_preempt.read.archive import data_start

#: Tensors up to this size are written from a template (the template's allocation is
#: transient and per shape); larger ones by ``torch.save`` (one call per many MiB).
TEMPLATE_MAX_BYTES = 16 << 20
#: Templates kept (one per dtype and shape; a few KiB each).
MAX_TEMPLATES = 1024

_templates: OrderedDict[tuple[bool, torch.dtype, tuple[int, ...]], tuple[bytes, bytes] | None] = OrderedDict()
_lock = threading.Lock()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(cast(Any, flat.numpy())).cast("B")


def _archive(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _build(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """(head, tail) around the data of an archive of this kind, or ``None`` when archives
    of it are not the same bytes around the data (see the module docstring)."""
    first = torch.zeros(shape, dtype=dtype)
    second = torch.empty(shape, dtype=dtype)
    second.view(-1).view(torch.uint8).fill_(0x5A)
    a, b = _archive(first), _archive(second)
    nbytes = first.numel() * first.element_size()
    start = data_start(memoryview(a[:4096]))
    if start is None or len(a) != len(b) or start + nbytes > len(a):
        return None
    end = start + nbytes
    same_around = a[:start] == b[:start] and a[end:] == b[end:]
    if not same_around or b[start:end] != bytes(_bytes_of(second)):
        return None
    return a[:start], a[end:]


def _template(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    # Keyed on the zip CRC-32 setting too: with it on, archives differ by data and no
    # template holds (a None cached then must not outlive the setting).
    key = (bool(torch.serialization.get_crc32_options()), tensor.dtype, tuple(tensor.shape))
    with _lock:
        if key in _templates:
            _templates.move_to_end(key)
            return _templates[key]
    built = _build(key[1], key[2])
    with _lock:
        _templates[key] = built
        while len(_templates) > MAX_TEMPLATES:
            _templates.popitem(last=False)
    return built


def _templatable(tensor: torch.Tensor) -> bool:
    nbytes = tensor.numel() * tensor.element_size()
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
        and 0 < nbytes <= TEMPLATE_MAX_BYTES
        and not tensor.is_quantized
        and not tensor.is_neg()
        and not tensor.is_conj()
    )


def write_tensor_record(stream: IO[bytes], tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """Write ``tensor`` to ``stream`` as the ``torch.save`` archive DCP stores per chunk;
    returns the template's ``(head, tail)`` used, ``None`` when ``torch.save`` wrote it.

    The caller has turned the zip CRC-32 off (``dcp_writer._skip_zip_crc32``); templates
    are built (and checked) under the same setting.
    """
    parts = _template(tensor) if _templatable(tensor) else None
    if parts is None:
        torch.save(tensor, stream)
        return None
    head, tail = parts
    stream.write(head)
    stream.write(_bytes_of(tensor))
    stream.write(tail)
    return parts


def clear_templates() -> None:
    """Forget every template (tests; a process that changed torch's serialization options)."""
    with _lock:
        _templates.clear()
