"""`hetserve store ...` and `hetserve bench store` from the command line."""

from __future__ import annotations

import json

from hetserve.cli import main


def test_bench_store_writes_json_with_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "store",
            "--backend",
            "local://?dram=64M",
            "--backend",
            "pool",
            "--sizes",
            "4K,1M",
            "--total",
            "2M",
            "--no-mooncake",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["machine"]  # the machine's facts, as every bench writes them
    backends = {r["backend"] for r in rows}
    assert backends == {"memcpy", "local://?dram=64M", "pool"}
    assert all(r["gbps"] > 0 and r["misses"] == 0 for r in rows)
    assert all(r["vs_memcpy"] is not None for r in rows)
    assert "xmemcpy" in capsys.readouterr().out


def test_bench_store_parts_layouts(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "store",
        "--backend",
        "local://?dram=64M",
        "--sizes",
        "64K",
        "--total",
        "512K",
        "--parts",
        "8",
        "--no-mooncake",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["backend"] != "memcpy"]
    assert {r["layout"] for r in rows} == {"1", "8", "8s"}
    assert all(r["misses"] == 0 and r["gbps"] > 0 for r in rows)
    split = [r for r in rows if r["layout"] != "1"]
    assert all(r["vs_contiguous"] is not None for r in split)
    assert all(r["vs_staged"] is not None for r in split if r["layout"] == "8")


def test_store_cli_errors_are_one_line(capsys):
    import socket

    busy = socket.socket()  # a port in use: a traceback before
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    assert main(["store", "node", "--master", "nowhere"]) == 2
    assert "--master wants HOST:PORT" in capsys.readouterr().err
    assert main(["store", "master", "--watermarks", "0.5,0.9"]) == 2
    # Each was taken without a word (a node that holds nothing, a master that declares every
    # node dead at once or takes no value).
    for argv, needle in (
        (["master", "--node-timeout", "-1"], "--node-timeout must be > 0"),
        (["master", "--max-value", "0"], "--max-value must be at least 1 byte"),
        (["node", "--master", "h:99999"], "--master wants HOST:PORT"),
        (["node", "--ssd", "1G"], "--ssd needs --ssd-dir"),
        (["node", "--ssd-dir", "/tmp"], "--ssd-dir needs --ssd SIZE"),
        (["node", "--dram", "0"], "the node would hold nothing"),
        (["node", "--dram", "4096G"], "lower --dram"),  # past the host's memory: the OOM killer
        (["master", "--port", str(busy.getsockname()[1])], "(in use); pick another --port"),
        (["node", "--port", str(busy.getsockname()[1]), "--dram", "16M"], "(in use)"),
    ):
        capsys.readouterr()
        assert main(["store", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err


def test_a_node_outside_the_pool_says_so(caplog):
    """`store node` with a wrong --master port or token printed 'ready on port N' and then
    retried in silence (at INFO, below the default WARNING): a pool without its DRAM."""
    import logging
    import time

    from hetserve.store.pool.master import PoolMaster
    from hetserve.store.pool.node import PoolNode

    master = PoolMaster(port=0, token="theirs")
    master.start()
    node = PoolNode(("127.0.0.1", master.port), 1 << 20, token="mine").start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.05)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "bad token" in warnings[0].getMessage()
        time.sleep(0.5)  # later retries of the same outage stay quiet
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    finally:
        node.close()
        master.close()
