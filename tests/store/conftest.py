"""Backends for the store contract suite, each started for real on 127.0.0.1.

A `Backend` bundles the spec a client opens, the capacity that eviction tests must overflow, a
way to damage one stored value (to check that a checksum failure reads as a miss), and whether
separate processes share its objects. A backend whose server is not installed skips with why.
"""

from __future__ import annotations

import pytest

from . import servers
from .helpers import Backend, MiB


def _corrupt_local(store, key: str) -> None:
    entry = store._dram[key]
    store._arena[entry.offset + entry.size // 2] ^= 0xFF


@pytest.fixture(scope="session")
def local_backend(tmp_path_factory) -> Backend:
    ssd = tmp_path_factory.mktemp("ssd")
    spec = f"local://?dram=80M&ssd_dir={ssd}&ssd=16M&max_value=96M"
    return Backend("local", spec, 96 * MiB, _corrupt_local, shared=False)


BACKENDS = ["local", "pool1", "pool3", "redis", "mooncake", "mooncake_direct"]


# Session scope: the contract modules share one set of servers (each start costs seconds).
@pytest.fixture(scope="session", params=BACKENDS)
def backend(request) -> Backend:
    name = request.param
    if name == "local":
        return request.getfixturevalue("local_backend")
    starter = getattr(servers, f"start_{name}", None)
    if starter is None:
        pytest.skip(f"{name}: backend not built yet")
    started = starter(request)
    request.addfinalizer(started.close_client)  # before the servers stop (finalizers are LIFO)
    return started


@pytest.fixture
def store(backend):
    if backend.keep_client:
        yield backend.client()
        return
    s = backend.open()
    yield s
    s.close()
