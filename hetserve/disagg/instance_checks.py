"""Whether an instance can join a cluster: the checks on the facts it gives at
`/internal/info`, as messages naming what to change.

Who calls it: `disagg/instances.py` (the Conductor's `Cluster`) when instances answer at start
or join later. Pure: no I/O; a check returns a message (or an empty string / None where all is
well) and the caller raises its `ClusterError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KV_IDENTITY = (
    "the KV identity (model, dtype, layout, block size or salt), so no prefix could be shared; "
    "serve the same model the same way"
)

# What an instance needs for each hand-off path beyond the direct one
HANDOFF_NEEDS = {
    "mooncake": "--handoff-mooncake",
    "store": "a shared KV store (--kv-store pool://..., redis://... or mooncake://...)",
}


def identity_difference(instances: Sequence[Any]) -> str:
    """What the disagreeing instances differ in, where their facts show it."""
    for what, key, flag in (("KV cache dtype", "kv_dtype", "--kv-cache-dtype"),
                            ("block size", "block_size", "--block-size")):  # fmt: skip
        values = {getattr(i, key) for i in instances if getattr(i, key) is not None}
        if len(values) > 1:
            seen = ", ".join(f"{i.name} {getattr(i, key)}" for i in instances)
            return f" ({what}: {seen}); start them with the same {flag}"
    return ""


def handoff_refusal(url: str, path: str | None, paths: Sequence[str] | None) -> str | None:
    """Why the instance at `url`, which hands KV off over `paths` (None: it does not say),
    cannot take the Conductor's hand-off `path` (None: no hand-off); None where it can."""
    if path is None or paths is None or path in paths:
        return None
    need = HANDOFF_NEEDS.get(path, f"the {path} hand-off path")
    return (
        f"instance {url} cannot hand KV off over {path} (it can over "
        f"{', '.join(paths) or 'nothing'}): start it with {need}, or the Conductor with another "
        "--handoff-path"
    )
