"""Op codes of the pool protocol (frames from `hetserve.transfer.framing`) and request checks.

Master ops carry JSON only; node ops READ/WRITE carry the value bytes as frame data. Batched
requests carry lists, so a batch costs one round trip to the master.
"""

from __future__ import annotations

from typing import Any

from hetserve.errors import InvalidInputError
from hetserve.store.api import MAX_KEY_LEN
from hetserve.transfer.tcp import RequestError, is_loopback

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


def want_float(raw: object, lo: float, hi: float, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not lo <= raw <= hi:
        raise RequestError(f"{what} must be a number in {lo}..{hi}", "bad_request")  # NaN too
    return float(raw)


def want_list(raw: object, what: str, limit: int = 100_000) -> list[Any]:
    if not isinstance(raw, list) or len(raw) > limit:
        raise RequestError(f"{what} must be a list of at most {limit}", "bad_request")
    return raw


def require_token(host: str, token: str) -> None:
    """Services refuse to listen beyond loopback without a shared token (checked here, in the
    services, so embedding them in Python gets the same rule as the CLI)."""
    if not is_loopback(host) and not token:
        raise InvalidInputError(
            f"refusing to bind {host} without a shared token: pass --token or set "
            "HETSERVE_STORE_TOKEN (clients then use pool://host:port?token=...)"
        )
