"""Op codes of the pool protocol (frames from `hetserve.transfer.framing`) and request checks.

Master ops carry JSON only; node ops READ/WRITE carry the value bytes as frame data. Batched
requests carry lists, so a batch costs one round trip to the master.
"""

from __future__ import annotations

from hetserve.store.api import MAX_KEY_LEN
from hetserve.transfer.tcp import RequestError

REGISTER, HEARTBEAT, UNREGISTER = 10, 11, 12
PUT_START, PUT_END, PUT_ABORT, LOCATE, EXISTS, REMOVE, STATS, NODES = range(20, 28)
READ, WRITE = 40, 41

DEFAULT_PORT = 7600


def want_key(raw: object) -> str:
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_KEY_LEN or not raw.isprintable():
        raise RequestError("bad key", "bad_key")
    return raw


def want_int(raw: object, lo: int, hi: int, what: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or not lo <= raw <= hi:
        raise RequestError(f"{what} must be an integer in {lo}..{hi}", "bad_request")
    return raw


def want_list(raw: object, what: str, limit: int = 100_000) -> list:
    if not isinstance(raw, list) or len(raw) > limit:
        raise RequestError(f"{what} must be a list of at most {limit}", "bad_request")
    return raw
