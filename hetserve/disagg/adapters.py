"""The LoRA adapters a cluster's instances serve, as the Conductor needs them for routing.

Who calls it: `disagg/conductor.py` (the content id an adapter request's blocks are hashed
with: the instances put `lora:<id>` in every block hash, so no KV is shared across adapters)
and the Conductor's app (/v1/models lists them; a runtime load or unload refreshes them). The
ids come from an instance's /v1/models cards (`lora_id`, hetserve's field), asked when a
request names a model that is neither the served one nor a known adapter, at most once a
second. The adapters loaded through the Conductor at run time (`record`) are loaded again on
an instance that joins later or comes back after being down (`replay`, the Cluster's
`prepare`): a restarted instance has lost them, a new one never had them.

Failure contract: none raises; an instance that does not answer is skipped, and with none the
ids stay as they were (a request then routes as if nothing were cached for it).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

log = logging.getLogger(__name__)

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class Adapters:
    def __init__(self, cluster: Any, every_s: float = 1.0) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.ids: dict[str, str] = {}  # adapter name -> content id
        self._asked = -1e9
        # Runtime loads some instance took, by adapter name: their bodies, to replay
        self.loads: dict[str, bytes] = {}

    def record(self, path: str, body: bytes, took: bool) -> None:
        """A load or unload the Conductor relayed; `took`: at least one instance did it."""
        try:
            name = json.loads(body)["lora_name"]
        except (ValueError, KeyError, TypeError):
            return
        if not took or not isinstance(name, str):
            return
        if path == LOAD:
            self.loads[name] = body
        elif path == UNLOAD:
            self.loads.pop(name, None)

    async def replay(self, inst: Any) -> None:
        """Load the cluster's runtime adapters on `inst` (one it has already is fine)."""
        for name, body in list(self.loads.items()):
            try:
                r = await self.cluster.http.post(inst.url + LOAD, content=body, timeout=300,
                                                 headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                log.warning("adapter %s not loaded on %s: %s", name, inst.name, exc)
                continue
            if r.status_code >= 300 and "already been loaded" not in r.text:
                log.warning("adapter %s not loaded on %s: %s %s", name, inst.name,
                            r.status_code, r.text[:300])  # fmt: skip
            elif r.status_code < 300:
                log.info("adapter %s loaded on %s", name, inst.name)

    def id_of(self, model: Any) -> str | None:
        return self.ids.get(model) if isinstance(model, str) else None

    async def learn(self, model: Any, alias: tuple[str, str] | None = None) -> None:
        """`model` may be an adapter loaded since the ids were read: read them again."""
        served = (self.cluster.model_card.get("id"), *(alias or ()))
        if not isinstance(model, str) or model in served or model in self.ids:
            return
        if time.monotonic() - self._asked < self.every_s:
            return
        await self.refresh()

    async def refresh(self) -> list[dict[str, Any]]:
        """The adapter cards one healthy instance lists (with a parent); [] if none answers."""
        self._asked = time.monotonic()
        for inst in [i for i in self.cluster.instances.values() if i.healthy]:
            try:
                r = await self.cluster.http.get(inst.url + "/v1/models", timeout=2)
                listed = r.json()["data"] if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
            if not isinstance(listed, list):
                continue
            cards = [c for c in listed if isinstance(c, dict) and c.get("parent")]
            self.ids = {str(c["id"]): str(c["lora_id"]) for c in cards if c.get("lora_id")}
            return cards
        return []
