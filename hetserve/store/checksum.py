"""Value checksums: xxh3-64 (tens of GB/s with AVX2, so verifying every read costs little next to
the copy; zlib's crc32 runs below 1 GB/s here and would dominate a DRAM hit).

`Envelope` frames a value for backends that store opaque blobs (redis, mooncake, local SSD files):
a fixed header with magic, length and digest, then the payload.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from hetserve.store.api import fit_parts

# What xxhash and memoryview accept: bytes-like objects.
Readable = bytes | bytearray | memoryview

_CHUNK = 256 * 1024  # copy and hash in L2-sized pieces so the hash reads cache-hot bytes

HEADER = struct.Struct("<4sIQQ")  # magic, reserved, payload length, xxh3-64 digest
MAGIC = b"HSv1"


def digest(buf: Readable) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def digest_parts(parts: Sequence[memoryview]) -> int:
    """The digest of the concatenation of `parts` (xxh3 streams: equal to hashing it whole)."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def copy_and_digest(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into the front of `dst` and return the digest of what landed in `dst`."""
    return copy_and_digest_parts([dst[: len(src)]], [src])


def copy_and_digest_parts(dst: Sequence[memoryview], src: Sequence[memoryview]) -> int:
    """Copy the bytes of `src` (buffers in order) over `dst` (the same total, cut differently)
    and return the digest of what landed, each piece hashed right after it lands (cache-hot)."""
    if len(dst) == 1 or len(src) == 1:  # gather into one buffer or scatter out of one
        return _copy_one_side(dst, src)
    h = xxhash.xxh3_64()
    di, doff = 0, 0
    for s in src:
        soff, n = 0, s.nbytes
        while soff < n:
            d = dst[di]
            k = min(n - soff, d.nbytes - doff, _CHUNK)
            if k == 0:  # this destination part is full
                di, doff = di + 1, 0
                continue
            piece = d[doff : doff + k]
            piece[:] = s[soff : soff + k]
            h.update(piece)
            soff, doff = soff + k, doff + k
    return h.intdigest()


def _copy_one_side(dst: Sequence[memoryview], src: Sequence[memoryview]) -> int:
    # The common cases, kept to one slice, one copy and one update per part: a KV block has
    # ~100 parts of a few KiB, where the per-part work of the general loop costs as much as
    # copying the bytes.
    h = xxhash.xxh3_64()
    off = 0
    if len(src) == 1:  # scatter
        one = src[0]
        for part in dst:
            n = part.nbytes
            if n > _CHUNK:
                _chunked(h, part, one[off : off + n], scatter=True)
            else:
                part[:] = one[off : off + n]
                h.update(part)
            off += n
    else:  # gather
        one = dst[0]
        for part in src:
            n = part.nbytes
            span = one[off : off + n]
            if n > _CHUNK:
                _chunked(h, part, span, scatter=False)
            else:
                span[:] = part
                h.update(span)
            off += n
    return h.intdigest()


def _chunked(h: xxhash.xxh3_64, part: memoryview, span: memoryview, scatter: bool) -> None:
    """A large part in L2-sized pieces, so each is hashed while still in cache."""
    for a in range(0, part.nbytes, _CHUNK):
        b = min(a + _CHUNK, part.nbytes)
        dst, src = (part[a:b], span[a:b]) if scatter else (span[a:b], part[a:b])
        dst[:] = src
        h.update(dst)


def pack_header(length: int, value_digest: int) -> bytes:
    return HEADER.pack(MAGIC, 0, length, value_digest)


def unpack_header(raw: Readable) -> tuple[int, int] | None:
    """(length, digest) of an envelope header, or None when it is not one of ours."""
    if len(raw) < HEADER.size:
        return None
    magic, _, length, value_digest = HEADER.unpack_from(raw)
    return (length, value_digest) if magic == MAGIC else None


def seal(payload: Readable) -> bytes:
    """Header + payload as one blob (one copy; for backends that take bytes)."""
    return pack_header(len(payload), digest(payload)) + bytes(payload)


def open_sealed(blob: Readable) -> memoryview | None:
    """The verified payload of a sealed blob, or None when it is damaged (a miss)."""
    head = unpack_header(blob)
    if head is None:
        return None
    length, value_digest = head
    payload = memoryview(blob)[HEADER.size :]
    if len(payload) != length or digest(payload) != value_digest:
        return None
    return payload


def unseal_into(
    blob: Readable | None, dest: list[memoryview], exact: bool, name: str
) -> int | None:
    """Copy the payload of a sealed blob into `dest` (cut by `fit_parts`), hashing as it lands;
    its length, or None when the blob is absent or damaged (a miss)."""
    head = None if blob is None else unpack_header(blob)
    if blob is None or head is None or len(blob) != HEADER.size + head[0]:
        return None
    parts = fit_parts(dest, head[0], exact, name)
    payload = memoryview(blob)[HEADER.size :]
    return head[0] if copy_and_digest_parts(parts, [payload]) == head[1] else None
