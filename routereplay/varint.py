"""Unsigned LEB128 varints (docs/FORMAT.md "Conventions"): shared by the sidecar's layout and
payloads; below both the codecs and the sidecar, importing nothing of routereplay."""
from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (>= 0) as an unsigned LEB128 varint: 7 bits a byte, least significant first,
    the high bit set on every byte but the last."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class VarintError(ValueError):
    """A varint runs past its buffer or past 10 bytes (callers turn it into a SidecarError
    naming the frame)."""


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``buf[pos]``.

    Raises:
        VarintError: the buffer ends inside the varint, or it is longer than 10 bytes.
    """
    n = shift = 0
    end = min(len(buf), pos + 10)
    while pos < end:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7
    raise VarintError("varint runs past its data" if pos >= len(buf)
                      else "varint longer than 10 bytes")
