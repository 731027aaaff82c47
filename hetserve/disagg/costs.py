"""What an instance's work costs in time: fitted from a profile it measured, read by the routing
policy (`policy.py`) in the live Conductor and in the simulator alike. Pure: no clock, and no
I/O but `save_profile` / `load_profile`.

- `PrefillFit`: seconds to prefill `new` tokens after `cached` tokens already in the KV cache,
  `c0 + c1 * new + c2 * new * (cached + new / 2)`: a per-step cost, the weights' work per token,
  and causal attention over the context (each new token attends to the cached ones and half of
  the new ones on average).
- `DecodeFit`: seconds of one decode step of `batch` sequences holding `context` tokens in all,
  `d0 + d1 * batch + d2 * context`: the weights streamed once a step, per-sequence work, and
  the KV cache read once a step.
- `DeliveryFit`: seconds a client waits beyond the prefill's compute on an idle deployment,
  `overhead_s + per_token_s * prompt tokens`: HTTP and tokenization, the KV hand-off to a
  decode instance and its admission, the first token's way back. Measured through a running
  server or cluster (`hetserve profile --through URL`); an engine-only profile has none.
- `InstanceProfile`: both fits, the KV bytes per token, the read cost of each tier the
  instance can load a prefix from (the KV tiers' own `TierCost`, probed by the instance), and
  the delivery fit where one was measured.

`fit_prefill` and `fit_decode` are ordinary least squares on measured samples (non-negative
coefficients), and `fit_error` is the mean relative error on samples the fit did not see: the
figure printed next to every prediction. Failure contract: too few samples to fit is a
ValueError naming how many are needed.

A profile saved as JSON (what `hetserve profile --out` writes, `hetserve sim --hardware` and
the Conductor read; `profile_to_dict` / `profile_from_dict`, the only I/O in `save_profile` /
`load_profile`):

    {"format": "hetserve-profile", "version": 1, "name": "8xA800 llama3-70b",
     "kv_bytes_per_token": 327680, "state_bytes_per_request": 0,
     "prefill": {"c0": 0.01, "c1": 9.5e-05, "c2": 4.2e-09, "fit_error": 0.03},
     "decode": {"d0": 0.0124, "d1": 5.7e-05, "d2": 2.9e-08, "fit_error": 0.02},
     "tiers": {"dram": {"latency_s": 0.0, "bandwidth": 1.28e11},
               "pool": {"latency_s": 0.001, "bandwidth": 8.7e10}},
     "capacity": {"device_kv_tokens": 1330000, "host_kv_tokens": 3000000},
     "delivery": {"overhead_s": 0.005, "per_token_s": 7e-06, "fit_error": 0.1},
     "samples": {"prefill": [[new, cached, seconds], ...], "decode": [[batch, context, s], ...]},
     "machine": {...}}

Seconds and bytes per second throughout. `state_bytes_per_request` (a hybrid model's
recurrent state of one sequence, moved with every load and hand-off; written where not 0),
`fit_error`, `capacity`, `delivery`, `samples` and `machine` are optional (`machine` is
free-form, for people); any other key, a missing one, or a negative or non-numeric value is a
ValueError naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from hetserve.core.least_squares import nonnegative_least_squares
from hetserve.kv.tier_policy import TierCost


@dataclass(frozen=True)
class PrefillFit:
    c0: float  # seconds per prefill step
    c1: float  # seconds per new token
    c2: float  # seconds per (new token x context token)

    def seconds(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        return self.c0 + self.c1 * new + self.c2 * new * (cached + new / 2)

    def queue_seconds(self, tokens: int, requests: int) -> float:
        """A queue of `requests` prompts holding `tokens` new tokens in all, prefilled one
        after the other (their attention terms unknown here: the linear part)."""
        if tokens <= 0:
            return 0.0
        return self.c0 * max(requests, 1) + self.c1 * tokens


@dataclass(frozen=True)
class DecodeFit:
    d0: float  # seconds per step
    d1: float  # seconds per sequence in the batch
    d2: float  # seconds per token of context held by the batch

    def seconds(self, batch: int, context: int) -> float:
        if batch <= 0:
            return 0.0
        return self.d0 + self.d1 * batch + self.d2 * context


@dataclass(frozen=True)
class DeliveryFit:
    overhead_s: float  # seconds per request, whatever its length
    per_token_s: float  # seconds per prompt token (the KV handed over grows with it)
    fit_error: float | None = None  # mean absolute error over the probes, seconds

    def seconds(self, tokens: int) -> float:
        return self.overhead_s + self.per_token_s * max(tokens, 0)


@dataclass(frozen=True)
class InstanceProfile:
    """One hardware/model combination, as `hetserve profile` measures it."""

    name: str
    prefill: PrefillFit
    decode: DecodeFit
    kv_bytes_per_token: int
    tiers: Mapping[str, TierCost] = field(default_factory=dict)  # tier -> read cost
    prefill_fit_error: float | None = None  # mean relative error on held-out samples
    decode_fit_error: float | None = None
    delivery: DeliveryFit | None = None  # None: an engine-only profile (nothing added)
    # Hybrid (linear-attention) models: one sequence's recurrent state, whatever its length.
    # A cached prefix resumes from its state checkpoint, read with the prefix's KV; a hand-off
    # carries the request's state beside its KV. 0 for attention-only models.
    state_bytes_per_request: int = 0

    def kv_bytes(self, tokens: int) -> int:
        """What `tokens` tokens of one request occupy and move: their KV, plus the state."""
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_request

    def delivery_seconds(self, tokens: int) -> float:
        """What the client waits beyond the prefill compute for a prompt of `tokens`."""
        return 0.0 if self.delivery is None else self.delivery.seconds(tokens)

    def load_seconds(self, tier: str, tokens: int) -> float | None:
        """Reading `tokens` tokens' KV from `tier` (None: a tier this instance cannot read)."""
        if tier == "device" or tokens <= 0:
            return 0.0
        cost = self.tiers.get(tier)
        if cost is None:
            return None
        return cost.load_time(self.kv_bytes(tokens))


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares (exact on these few columns); zeros where nothing solves."""
    return nonnegative_least_squares(rows, ys) or [0.0] * len(rows[0])


PrefillSample = tuple[int, int, float]  # (new tokens, cached tokens, seconds)
DecodeSample = tuple[int, int, float]  # (batch, context tokens, seconds)


def _prefill_row(new: int, cached: int) -> list[float]:
    return [1.0, float(new), new * (cached + new / 2)]


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillFit:
    if not samples:
        raise ValueError("a prefill fit needs at least 1 sample, got 0")
    # Relative error matters (a 2 ms and a 2 s prefill alike): weight each row by 1 / seconds.
    rows = [[x / s for x in _prefill_row(n, c)] for n, c, s in samples]
    c0, c1, c2 = _lstsq(rows, [1.0] * len(samples))
    return PrefillFit(c0, c1, c2)


def fit_delivery(samples: Sequence[tuple[int, float]]) -> DeliveryFit:
    """`overhead_s + per_token_s * tokens` through (prompt tokens, seconds beyond the prefill's
    predicted compute) samples: unweighted least squares, both terms >= 0 (a residual is an
    absolute wait, so a short prompt's noise counts as much as a long one's)."""
    if len(samples) < 2:
        raise ValueError(f"a delivery fit needs at least 2 samples, got {len(samples)}")
    a, b = _lstsq([[1.0, float(n)] for n, _ in samples], [s for _, s in samples])
    err = sum(abs(a + b * n - s) for n, s in samples) / len(samples)
    return DeliveryFit(a, b, err)


def fit_decode(samples: Sequence[DecodeSample]) -> DecodeFit:
    if not samples:
        raise ValueError("a decode fit needs at least 1 sample, got 0")
    rows = [[1.0 / s, b / s, c / s] for b, c, s in samples]
    d0, d1, d2 = _lstsq(rows, [1.0] * len(samples))
    return DecodeFit(d0, d1, d2)


class _Fit(Protocol):
    def seconds(self, a: int, b: int) -> float: ...


F = TypeVar("F", bound=_Fit)


def fit_error(fit: _Fit, samples: Sequence[tuple[int, int, float]]) -> float:
    """Mean relative error |predicted - measured| / measured of `fit` on `samples`."""
    errs = [abs(fit.seconds(a, b) - s) / s for a, b, s in samples if s > 0]
    return sum(errs) / len(errs) if errs else math.nan


def held_out(
    samples: Sequence[tuple[int, int, float]],
    fitter: Callable[[Sequence[tuple[int, int, float]]], F],
    every: int = 4,
) -> tuple[F, float]:
    """Fit on all samples but every `every`-th, measure the error on those (NaN if too few),
    then refit on all: the fit to use and the error to print beside its predictions."""
    held = [x for i, x in enumerate(samples) if i % every == every - 1]
    train = [x for i, x in enumerate(samples) if i % every != every - 1]
    err = fit_error(fitter(train), held) if held and len(train) >= 3 else math.nan
    return fitter(samples), err


PROFILE_FORMAT = "hetserve-profile"
PROFILE_VERSION = 1
_PROFILE_KEYS = {"format", "version", "name", "kv_bytes_per_token", "prefill", "decode", "tiers"}
_PROFILE_OPTIONAL = {"capacity", "delivery", "samples", "machine", "state_bytes_per_request"}


def profile_to_dict(profile: InstanceProfile, **extra: Any) -> dict[str, Any]:
    """The JSON form of `profile`; `extra` adds the optional sections (`capacity`,
    `samples`, `machine`; `delivery` comes from the profile itself)."""
    unknown = set(extra) - (_PROFILE_OPTIONAL - {"delivery", "state_bytes_per_request"})
    if unknown:
        raise ValueError(f"profile: unknown section(s) {sorted(unknown)}")
    p, d = profile.prefill, profile.decode
    out: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "name": profile.name,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "prefill": {
            "c0": p.c0,
            "c1": p.c1,
            "c2": p.c2,
            "fit_error": _known(profile.prefill_fit_error),
        },
        "decode": {
            "d0": d.d0,
            "d1": d.d1,
            "d2": d.d2,
            "fit_error": _known(profile.decode_fit_error),
        },
        "tiers": {
            t: {"latency_s": c.latency_s, "bandwidth": c.bandwidth}
            for t, c in profile.tiers.items()
        },
    }
    if profile.state_bytes_per_request:
        out["state_bytes_per_request"] = profile.state_bytes_per_request
    if profile.delivery is not None:
        v = profile.delivery
        out["delivery"] = {
            "overhead_s": v.overhead_s,
            "per_token_s": v.per_token_s,
            "fit_error": v.fit_error,
        }
    return {**out, **extra}


def profile_from_dict(data: Mapping[str, Any]) -> InstanceProfile:
    """An `InstanceProfile` from its JSON form (see the module docstring); ValueError naming
    the field at fault."""
    if not isinstance(data, Mapping):
        raise ValueError("profile: expected a JSON object")
    missing = _PROFILE_KEYS - set(data)
    if missing:
        raise ValueError(f"profile: missing field(s) {sorted(missing)}")
    unknown = set(data) - _PROFILE_KEYS - _PROFILE_OPTIONAL
    if unknown:
        raise ValueError(f"profile: unknown field(s) {sorted(unknown)}")
    if data["format"] != PROFILE_FORMAT or data["version"] != PROFILE_VERSION:
        raise ValueError(
            f"profile: format {data['format']!r} version {data['version']!r}: "
            f"expected {PROFILE_FORMAT!r} version {PROFILE_VERSION}"
        )
    if not isinstance(data["name"], str):
        raise ValueError("profile.name: expected a string")
    kv = _num(data, "kv_bytes_per_token", "profile.kv_bytes_per_token")
    pre, dec = _section(data, "prefill"), _section(data, "decode")
    tiers = data["tiers"]
    if not isinstance(tiers, Mapping):
        raise ValueError("profile.tiers: expected an object of tier -> cost")
    costs = {}
    for tier, cost in tiers.items():
        where = f"profile.tiers.{tier}"
        if not isinstance(cost, Mapping):
            raise ValueError(f"{where}: expected an object with latency_s and bandwidth")
        bw = _num(cost, "bandwidth", f"{where}.bandwidth")
        if bw <= 0:
            raise ValueError(f"{where}.bandwidth: must be > 0")
        costs[str(tier)] = TierCost(_num(cost, "latency_s", f"{where}.latency_s"), bw)
    return InstanceProfile(
        name=data["name"],
        prefill=PrefillFit(*(_num(pre, k, f"profile.prefill.{k}") for k in ("c0", "c1", "c2"))),
        decode=DecodeFit(*(_num(dec, k, f"profile.decode.{k}") for k in ("d0", "d1", "d2"))),
        kv_bytes_per_token=int(kv),
        tiers=costs,
        prefill_fit_error=_opt_num(pre, "fit_error", "profile.prefill.fit_error"),
        decode_fit_error=_opt_num(dec, "fit_error", "profile.decode.fit_error"),
        delivery=_delivery(data),
        state_bytes_per_request=_state_bytes(data),
    )


def _state_bytes(data: Mapping[str, Any]) -> int:
    if "state_bytes_per_request" not in data:
        return 0
    n = _num(data, "state_bytes_per_request", "profile.state_bytes_per_request")
    if n < 0:
        raise ValueError("profile.state_bytes_per_request: must be >= 0")
    return int(n)


def _delivery(data: Mapping[str, Any]) -> DeliveryFit | None:
    if data.get("delivery") is None:
        return None
    sec = _section(data, "delivery")
    return DeliveryFit(
        _num(sec, "overhead_s", "profile.delivery.overhead_s"),
        _num(sec, "per_token_s", "profile.delivery.per_token_s"),
        _opt_num(sec, "fit_error", "profile.delivery.fit_error"),
    )


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    sec = data[key]
    if not isinstance(sec, Mapping):
        raise ValueError(f"profile.{key}: expected an object")
    return sec


def _num(data: Mapping[str, Any], key: str, where: str) -> float:
    if key not in data:
        raise ValueError(f"{where}: missing")
    x = data[key]
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{where}: expected a number >= 0, got {x!r}")
    return float(x)


def _opt_num(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None  # NaN: an error too few samples could measure (JSON has no NaN: null)
    return _num(data, key, where)


def _known(error: float | None) -> float | None:
    """A fit error for JSON: NaN (too few samples held out) is written as null."""
    return None if error is None or math.isnan(error) else error


def save_profile(path: str, profile: InstanceProfile, **extra: Any) -> None:
    Path(path).write_text(json.dumps(profile_to_dict(profile, **extra), indent=2) + "\n")


def load_profile(path: str) -> tuple[InstanceProfile, dict[str, Any]]:
    """The profile at `path` and its whole JSON object (for the optional sections). A file
    that is missing or not JSON is a ValueError naming the path."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    try:
        return profile_from_dict(data), data
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
