"""A kernel filter on the heartbeat socket: only datagrams from the peers' addresses are queued.

A flood from anywhere else is dropped by the kernel before it reaches the socket's buffer, so
it can neither fill that buffer (the real datagrams would be dropped with it) nor cost the
rank's Python a thing. A peer's datagrams come from the address it bound and
announced (``Heartbeat.address``); an unprivileged local user cannot send from a bound port,
nor from another host's address. Classic BPF (``SO_ATTACH_FILTER``), Linux only; elsewhere,
or for more peers than one program holds, nothing is filtered and the heartbeat's own checks
(HMAC, then the sequence number) drop what comes.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable

_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000  # offsets from the IP header (a UDP socket's program starts at the UDP header)
_MAX_INSNS = 4096  # BPF_MAXINSNS
_PER_PEER = 5


class _Program(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(peers: Iterable[tuple[str, int]]) -> bytes | None:
    """The filter's instructions accepting datagrams from ``peers`` (IPv4, port) only, or
    ``None`` when they cannot be told by address (a wildcard or non-IPv4 host, too many)."""
    code = []
    for host, port in sorted(set(peers)):
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            return None
        if ip.is_unspecified or not 0 < port < 65536:
            return None
        code += [
            _insn(0x20, 0, 0, _SKF_NET_OFF + 12),  # A = the source address (ld w abs)
            _insn(0x15, 0, 3, int(ip)),  # not this peer's: on to the next
            _insn(0x28, 0, 0, 0),  # A = the UDP source port (ldh abs)
            _insn(0x15, 0, 1, port),
            _insn(0x06, 0, 0, 0xFFFFFFFF),  # this peer's: queue it whole
        ]
    code.append(_insn(0x06, 0, 0, 0))  # anyone else's: drop
    return b"".join(code) if len(code) <= _MAX_INSNS else None


def admit_only(sock: socket.socket, peers: Iterable[tuple[str, int]]) -> bool:
    """Attach the filter of :func:`program` to ``sock``; ``False`` where it could not be."""
    code = program(peers)
    if code is None or not sys.platform.startswith("linux"):
        return False
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _Program(len(code) // 8, ctypes.addressof(buffer))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(prog))  # the kernel copies the program
    except OSError:
        return False
    return True
