"""Length-prefixed frames on a TCP stream: a 4-byte big-endian length and a msgpack header, then, where
the header announces them, raw tensor bytes. Never pickle."""

from __future__ import annotations

import socket
import struct

import msgspec

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict)


class PeerClosed(ConnectionError):
    """The other side closed the connection."""


def send_header(sock: socket.socket, header: dict) -> None:
    data = _encoder.encode(header)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exactly(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise PeerClosed(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_header(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exactly(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"a {n}-byte frame header is not a KV-transfer frame (a different protocol?)")
    return _decoder.decode(recv_exactly(sock, n))
