"""What a benchmark learns about the server under test over plain HTTP: its model card
(`GET /v1/models`) and its Prometheus `/metrics`. Works against any OpenAI-compatible server;
what a server does not report comes back as None, never as a guess.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from typing import Any

from hetserve.errors import InvalidInputError

# Sample names read from /metrics: hetserve's own first, then the names vLLM exports (which
# hetserve adds too), so the same soak reads both servers.
KV_BLOCKS_USED = ("hetserve_kv_blocks_used",)
KV_USAGE_FRACTION = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = ("hetserve_num_requests_running", "vllm:num_requests_running")
WAITING = ("hetserve_num_requests_waiting", "vllm:num_requests_waiting")
RSS_BYTES = ("process_resident_memory_bytes",)
_SAMPLE_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def api_url(base_url: str, path: str) -> str:
    """`base_url` + an API path; accepts both http://h:p and http://h:p/v1 as the base."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[len("/v1") :]
    return base + path


def metrics_url(base_url: str) -> str:
    """/metrics sits at the server's root, also when the base URL ends with /v1."""
    base = base_url.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/metrics"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_text(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """GET a URL; raises OSError (urllib.error.URLError, HTTPError) when it cannot."""
    req = urllib.request.Request(url, headers=auth_headers(api_key))
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8", "replace")


def model_cards(base_url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """The `data` list of /v1/models; [] when the server has no such route or answers oddly.

    Unreachable is a user mistake (wrong URL, server down), said in one line before any load.
    """
    url = api_url(base_url, "/v1/models")
    try:
        doc = json.loads(get_text(url, api_key))
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise InvalidInputError(
                f"{url} answered HTTP {exc.code}: give the server's key with --api-key "
                "(or $OPENAI_API_KEY)"
            ) from None
        return []  # servers without the route: no facts, no crash
    except OSError as exc:
        raise InvalidInputError(f"cannot reach {url} ({exc}); is the server up?") from None
    except ValueError:
        return []  # not JSON
    data = doc.get("data") if isinstance(doc, dict) else None
    return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []


def card_int(card: dict[str, Any] | None, key: str) -> int | None:
    """A positive integer field of a model card, None when absent or not a positive integer."""
    value = (card or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}; labelled samples of one name are summed.

    Only what a soak needs: no types, no timestamps. Lines that do not parse are skipped, so a
    server's odd line never costs the run.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE_NAME.match(line)
        if m is None:
            continue  # comments (# HELP, # TYPE), blank lines
        rest = line[m.end() :]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            values[m.group()] = values.get(m.group(), 0.0) + value
    return values


def first_of(values: dict[str, float] | None, names: tuple[str, ...]) -> float | None:
    """The value of the first of `names` the server exports, None when it exports none."""
    if values is None:
        return None
    return next((values[n] for n in names if n in values), None)
