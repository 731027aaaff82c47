"""Optional clients: a backend whose client library is missing says, in one line, which extra
to install (the import is made to fail, whatever is installed here)."""

from __future__ import annotations

import sys

import pytest

from hetserve.cli import main
from hetserve.store import StoreDependencyError, open_store


def test_redis_without_its_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    with pytest.raises(StoreDependencyError) as exc:
        open_store("redis://127.0.0.1:6379/0")
    assert str(exc.value) == "redis:// needs the redis client: pip install 'hetserve[redis]'"


def test_mooncake_without_its_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(StoreDependencyError) as exc:
        open_store("mooncake://127.0.0.1:50051")
    assert str(exc.value) == "mooncake:// needs Mooncake: pip install 'hetserve[mooncake]'"


def test_the_cli_prints_it_as_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "redis", None)
    rc = main(
        [
            "bench",
            "store",
            "--backend",
            "redis://127.0.0.1:1/0",
            "--sizes",
            "4K",
            "--total",
            "4K",
            "--no-mooncake",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "pip install 'hetserve[redis]'" in err
