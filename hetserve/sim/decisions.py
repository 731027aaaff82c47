"""Decision logs: what the Conductor saw and chose, one JSON line per request, so that any
other caller of the policy (the simulator, a test, a later version of the policy) can replay the
same states and compare its choices with the recorded ones.

The first line is a header, `{"router": RouterConfig fields}`; then one line per decision:

    {"now": 12.5, "request": {RequestInfo fields},
     "view": {"block_size": 512, "profiles": {name: profile JSON (costs.profile_to_dict)},
              "instances": [{InstanceState fields, "profile": name, "role": "prefill"}],
              "holdings": {holder: {tier: blocks}}},
     "decision": {Decision fields, "pull": {source, tier, blocks} | null}}

Who writes it: `hetserve sim --log-decisions FILE`, and anything that wraps a live Conductor's
`router.decide` with `DecisionLog.record` (the tests do; a `--log-decisions` option of
`hetserve conductor` would be the same two lines). Who reads it: `replay`, which runs a fresh
`Router` over the recorded views in order (round-robin's position and random's generator
advance as they did) and returns the decisions that differ. Failure contract: a line that is
not such a record is a ValueError naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import IO, Any

from hetserve.config import Role
from hetserve.disagg.costs import InstanceProfile, profile_from_dict, profile_to_dict
from hetserve.disagg.policy import (
    ClusterView,
    Decision,
    InstanceState,
    PrefixHolding,
    Pull,
    RequestInfo,
    Router,
    RouterConfig,
)


def view_to_dict(view: ClusterView) -> dict[str, Any]:
    profiles: dict[str, dict[str, Any]] = {}
    instances = []
    for inst in view.instances:
        profiles.setdefault(inst.profile.name, profile_to_dict(inst.profile))
        row = {f.name: getattr(inst, f.name) for f in fields(inst)}
        row |= {
            "profile": inst.profile.name,
            "role": inst.role.value,
            "decode_changes": [list(c) for c in inst.decode_changes],
        }
        instances.append(row)
    holdings = {h: dict(p.blocks) for h, p in view.holdings.items()}
    return {
        "block_size": view.block_size,
        "profiles": profiles,
        "instances": instances,
        "holdings": holdings,
    }


def view_from_dict(data: Mapping[str, Any]) -> ClusterView:
    profiles: dict[str, InstanceProfile] = {
        name: profile_from_dict(p) for name, p in data["profiles"].items()
    }
    instances = []
    for row in data["instances"]:
        kw = dict(row)
        kw["profile"] = profiles[row["profile"]]
        kw["role"] = Role(row["role"])
        kw["decode_changes"] = tuple(tuple(c) for c in row.get("decode_changes", ()))
        instances.append(InstanceState(**kw))
    holdings = {h: PrefixHolding(h, dict(b)) for h, b in data["holdings"].items()}
    return ClusterView(instances, holdings, int(data["block_size"]))


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    out = asdict(decision)
    out["scores"] = dict(decision.scores)
    return out


def decision_from_dict(data: Mapping[str, Any]) -> Decision:
    kw = dict(data)
    kw["pull"] = Pull(**data["pull"]) if data.get("pull") else None
    return Decision(**kw)


def router_to_dict(config: RouterConfig) -> dict[str, Any]:
    out = asdict(config)
    out["tier_credits"] = dict(config.tier_credits)
    return out


class DecisionLog:
    """Writes a decision log; `record` fits `Simulation`'s hook."""

    def __init__(self, path: str, config: RouterConfig) -> None:
        self._file: IO[str] = Path(path).open("w")
        self._file.write(json.dumps({"router": router_to_dict(config)}) + "\n")

    def record(self, view: ClusterView, req: RequestInfo, now: float, decision: Decision) -> None:
        row = {
            "now": now,
            "request": asdict(req),
            "view": view_to_dict(view),
            "decision": decision_to_dict(decision),
        }
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def read_log(path: str) -> tuple[RouterConfig, list[dict[str, Any]]]:
    lines = Path(path).read_text().splitlines()
    try:
        head = json.loads(lines[0])["router"]
        config = RouterConfig(**head)
    except (IndexError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} line 1: not a decision log header ({exc})") from None
    rows = []
    for lineno, line in enumerate(lines[1:], 2):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {lineno}: not JSON ({exc.msg})") from None
    return config, rows


def replay(config: RouterConfig, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Decide every recorded view again with a fresh router: the records whose decision
    differs, each with what the replay decided (empty: the same code decided the same)."""
    router = Router(config)
    mismatches = []
    for i, row in enumerate(rows):
        try:
            view, req = view_from_dict(row["view"]), RequestInfo(**row["request"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"decision {i + 1}: not a decision record ({exc})") from None
        again = decision_to_dict(router.decide(view, req, float(row["now"])))
        if again != row["decision"]:
            mismatches.append({"index": i, "recorded": row["decision"], "replayed": again})
    return mismatches
