"""The opcode check run before C ``pickle`` (rules and why: docs/security.md).

``find_class`` does not bound C ``pickle`` (``BUILD`` on an allowed global, a huge memo
index), so the pickle is walked first: only what torch's weights-only unpickler reads is
allowed, else :class:`FastRefused` and the weights-only loader decides. No torch here.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Set

#: What a value on the walked stack is; globals and what calling them returns are strings.
_OTHER, _TUPLE, _LIST, _DICT = 0, 1, 2, 3


class FastRefused(Exception):
    """The pickle does something the fast path does not let C ``pickle`` run."""


def check_fast_pickle(
    pkl: bytes,
    *,
    globals_allowed: Collection[str],
    callables: Collection[str],
    buildable: Collection[str],
    dict_like: Collection[str],
) -> None:
    """Raise :class:`FastRefused` unless every opcode of ``pkl`` (protocol 2) is one the fast
    path allows: a ``GLOBAL`` of ``globals_allowed`` (``"module.name"``), ``REDUCE``/``NEWOBJ``
    of ``callables``, ``BUILD`` on what ``buildable`` made (with a dict state on a ``dict_like``'s:
    the weights-only loader refuses slot state there), ``SETITEM(S)`` on a ``dict_like``'s."""
    try:
        _walk(pkl, *map(frozenset, (globals_allowed, callables, buildable, dict_like)))
    except FastRefused:
        raise
    except (IndexError, KeyError, ValueError, struct.error, UnicodeDecodeError) as err:  # truncated, underflow…
        raise FastRefused(f"malformed pickle ({type(err).__name__})") from None


# one dispatch loop, its branches ordered by how often torch.save writes each op
def _walk(pkl: bytes, globals_allowed: Set[str], callables: Set[str], buildable: Set[str], dict_like: Set[str]) -> None:
    if pkl[:2] != b"\x80\x02":
        raise FastRefused("not a protocol-2 pickle")
    unpack_i = struct.Struct("<I").unpack_from
    stack: list[object] = []
    metastack: list[list[object]] = []
    memo: list[object] = []  # a torch.save pickle memoizes 0, 1, 2...: a list, never sparse
    pos, end = 2, len(pkl)
    while pos < end:
        op = pkl[pos]
        pos += 1
        if op == 0x72 or op == 0x71:  # LONG_BINPUT, BINPUT
            if op == 0x72:
                idx = unpack_i(pkl, pos)[0]
                pos += 4
            else:
                idx = pkl[pos]
                pos += 1
            if idx == len(memo):
                memo.append(stack[-1])
            elif idx < len(memo):
                memo[idx] = stack[-1]
            else:  # C pickle sizes its memo array by the largest index a file names
                raise FastRefused(f"memo index {idx} after {len(memo)} values")
        elif op == 0x58:  # BINUNICODE
            pos += 4 + unpack_i(pkl, pos)[0]
            stack.append(_OTHER)
        elif op == 0x52 or op == 0x81:  # REDUCE, NEWOBJ
            args = stack.pop()
            func = stack[-1]
            if func not in callables or args is not _TUPLE:
                raise FastRefused(f"{'REDUCE' if op == 0x52 else 'NEWOBJ'} of {func!r}")
            stack[-1] = "=" + func  # type: ignore[operator]
        elif op == 0x85:  # TUPLE1
            stack[-1] = _TUPLE
        elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
            if op == 0x68:
                idx = pkl[pos]
                pos += 1
            else:
                idx = unpack_i(pkl, pos)[0]
                pos += 4
            stack.append(memo[idx])
        elif op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
        elif op == 0x75 or op == 0x73:  # SETITEMS, SETITEM
            if op == 0x75:
                items = stack
                stack = metastack.pop()
                if len(items) % 2:
                    raise FastRefused("SETITEMS with an odd number of items")
            else:
                del stack[-2:]
            target = stack[-1]
            if target is not _DICT and not (isinstance(target, str) and target[:1] == "=" and target[1:] in dict_like):
                raise FastRefused("SETITEM on something other than a dict")
        elif op == 0x65 or op == 0x61:  # APPENDS, APPEND
            if op == 0x65:
                stack = metastack.pop()
            else:
                stack.pop()
            if stack[-1] is not _LIST:
                raise FastRefused("APPEND to something other than a list")
        elif op == 0x74:  # TUPLE
            stack = metastack.pop()
            stack.append(_TUPLE)
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [_TUPLE]
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [_TUPLE]
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(_TUPLE)
        elif op == 0x5D:  # EMPTY_LIST
            stack.append(_LIST)
        elif op == 0x7D:  # EMPTY_DICT
            stack.append(_DICT)
        elif op in _NO_ARG_VALUES:  # NONE, NEWTRUE, NEWFALSE, EMPTY_SET
            stack.append(_OTHER)
        elif op in _FIXED_ARG:  # BININT*, BINFLOAT
            pos += _FIXED_ARG[op]
            stack.append(_OTHER)
        elif op == 0x55 or op == 0x8A:  # SHORT_BINSTRING, LONG1
            pos += 1 + pkl[pos]
            stack.append(_OTHER)
        elif op == 0x63:  # GLOBAL
            nl1 = pkl.index(b"\n", pos)
            nl2 = pkl.index(b"\n", nl1 + 1)
            name = f"{pkl[pos:nl1].decode('ascii')}.{pkl[nl1 + 1 : nl2].decode('ascii')}"
            pos = nl2 + 1
            if name not in globals_allowed:
                raise FastRefused(f"GLOBAL {name}")
            stack.append(name)
        elif op == 0x62:  # BUILD
            state = stack.pop()
            inst = stack[-1]
            if not (isinstance(inst, str) and inst[:1] == "=" and inst[1:] in buildable):
                raise FastRefused(f"BUILD on {inst!r}")
            if inst[1:] in dict_like and state is not _DICT:  # weights_only: inst.__dict__.update(state)
                raise FastRefused(f"BUILD on {inst[1:]} with a state that is not a dict (slot state)")
        elif op == 0x51:  # BINPERSID: torch's persistent_load (storages)
            if stack[-1] is not _TUPLE:
                raise FastRefused("persistent id that is not a tuple")
            stack[-1] = _OTHER
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or metastack or pos != end:
                raise FastRefused("STOP with more than one value or bytes after it")
            if isinstance(stack[0], str) and stack[0][:1] != "=":
                raise FastRefused("the pickle's value is a global")
            return
        else:
            raise FastRefused(f"opcode {op:#04x}")
        if pos > end:
            raise FastRefused("truncated pickle")
    raise FastRefused("no STOP")


_NO_ARG_VALUES = frozenset({0x4E, 0x88, 0x89, 0x8F})
_FIXED_ARG = {0x4A: 4, 0x4B: 1, 0x4D: 2, 0x47: 8}
