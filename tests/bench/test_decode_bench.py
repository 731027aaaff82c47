"""`hetserve bench decode` on a tiny MoE: end to end, roofline bytes, errors, llama.cpp peer."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hetserve.bench.decode import LLAMACPP_SRC_ENV
from hetserve.bench.weight_bytes import (
    dense_bytes_per_token_fp32,
    expert_bytes_int8,
    expert_bytes_per_token,
    moe_layer_count,
)
from hetserve.cli import main

FAST = ["--tokens", "6", "--prompt-len", "8", "--repeats", "1", "--rounds", "1",
        "--bandwidth-mib", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tiny_model):
    return tiny_model("qwen3-moe")


def test_bench_decode_end_to_end_writes_json(moe_dir, tmp_path, capsys):
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, "--skip-llamacpp",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rates = data["decode_tokens_per_s"]
    expected = {"hetserve cpu-int8", "hetserve fp32", "transformers fp32"}
    if not torch.cuda.is_available():  # int8 non-expert linears: a CPU-only configuration
        expected.add("hetserve all-int8")
    assert set(rates) == expected
    assert all(r > 0 for r in rates.values())
    assert data["vs_transformers"]["transformers fp32"] == pytest.approx(1.0)
    assert data["llamacpp_peer"] == "llama.cpp q8_0"
    assert data["vs_llamacpp"]["hetserve cpu-int8"] is None  # peer skipped
    roof = data["roofline"]
    assert roof["bytes_per_token"] == expert_bytes_per_token(json.loads(
        (moe_dir / "config.json").read_text()))["bytes_per_token"]  # fmt: skip
    assert roof["bandwidth_gbps"] > 0 and roof["fraction_of_bandwidth"] > 0
    assert roof["total_fraction_of_bandwidth"] > roof["fraction_of_bandwidth"]
    text = capsys.readouterr().out
    assert "vs llama.cpp q8_0" in text and "routed experts streamed per token" in text


def test_bench_decode_skip_hf_and_rounds(moe_dir, tmp_path):
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, "--skip-llamacpp", "--skip-hf",
               "--skip-reference", "--rounds", "2", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rates, rounds = data["decode_tokens_per_s"], data["rounds_tokens_per_s"]
    expected = ["hetserve cpu-int8"] + ([] if torch.cuda.is_available() else ["hetserve all-int8"])
    assert list(rates) == expected and data["rounds"] == 2
    for name in expected:  # each system timed once per round, the best round reported
        assert len(rounds[name]) == 2 and rates[name] == max(rounds[name]) > 0


def test_bad_rounds_exit_2(moe_dir, capsys):
    rc = main(["bench", "decode", "--model", str(moe_dir), "--rounds", "0", "--skip-llamacpp"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--rounds" in err and "\n" not in err


def test_roofline_bytes_match_a_hand_computation():
    # Qwen3-MoE, hidden 64, expert inter 32, top-2 of 8, 3 layers of which layer 1 is dense.
    cfg = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 128,
           "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3,
           "decoder_sparse_step": 1, "mlp_only_layers": [1]}  # fmt: skip
    # gate+up+down int8: 3*64*32 = 6144 B; fp32 scales: (2*32 + 64)*4 = 512 B.
    assert expert_bytes_int8(64, 32) == 6656
    got = expert_bytes_per_token(cfg)
    assert got == {"moe_layers": 2, "top_k": 2, "expert_bytes": 6656, "bytes_per_token": 26624}
    # Non-expert fp32 weights: q,o 64x64 and k,v 64x32 per layer (4 heads of 16, 2 KV heads),
    # router 8x64 in the 2 MoE layers, layer 1's dense MLP 3x64x128, lm_head 512x64.
    cfg |= {"num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": 2, "vocab_size": 512}
    params = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 2 * 8 * 64 + 3 * 64 * 128 + 512 * 64
    assert params == 95232
    assert dense_bytes_per_token_fp32(cfg) == 4 * params
    assert dense_bytes_per_token_fp32({**cfg, "kv_lora_rank": 512}) is None  # MLA: not modelled
    mixtral = {"num_hidden_layers": 4, "num_local_experts": 8}
    assert moe_layer_count(mixtral) == 4
    deepseek = {"num_hidden_layers": 5, "n_routed_experts": 8, "first_k_dense_replace": 1}
    assert moe_layer_count(deepseek) == 4


def test_expert_bytes_match_the_cpu_int8_backend():
    from hetserve.moe.experts import ExpertWeights, create_backend

    e, i, h = 4, 32, 64
    w = ExpertWeights(torch.randn(e, 2 * i, h), torch.randn(e, h, i))
    assert create_backend("cpu-int8", w).nbytes() == e * expert_bytes_int8(h, i)


def test_missing_model_dir_exits_2_with_one_line(tmp_path, capsys):
    rc = main(["bench", "decode", "--model", str(tmp_path / "nope"), "--skip-llamacpp"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "config.json" in err and "\n" not in err


def test_llamacpp_peer_converts_and_loads(moe_dir, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from hetserve.bench.decode_llamacpp import convert, find_converter

    src = find_converter(os.environ.get(LLAMACPP_SRC_ENV))
    if src is None:
        pytest.skip(f"no llama.cpp converter: set ${LLAMACPP_SRC_ENV} to a llama.cpp source tree")
    gguf = convert(moe_dir, tmp_path / "tiny-q8_0.gguf", src, "q8_0")
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=32, verbose=False)
    try:
        cfg = json.loads((moe_dir / "config.json").read_text())
        assert llm.n_vocab() == cfg["vocab_size"]
        gen = llm.generate([1, 2, 3], temp=0.0, top_k=1)
        assert 0 <= next(gen) < cfg["vocab_size"]
        gen.close()
    finally:
        llm.close()


def test_every_gguf_type_names_a_llamacpp_file_type():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from hetserve.bench.decode_llamacpp import GGUF_TYPES, QUANT_TYPES

    assert GGUF_TYPES[0] == "q8_0" and set(GGUF_TYPES[1:]) == set(QUANT_TYPES)
    for kind, (ftype, pure) in QUANT_TYPES.items():
        assert isinstance(getattr(llama_cpp, ftype), int), kind
        assert pure == (kind == "q4_K")  # the mixes keep llama.cpp's own choice per tensor


def test_llamacpp_missing_is_skipped_with_the_reason(moe_dir, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, "--skip-hf", "--skip-reference",
               "--skip-gguf-hetserve", "--json", str(out)])  # fmt: skip
    assert rc == 0
    assert "llama.cpp: not run: llama-cpp-python is not installed" in capsys.readouterr().out
    assert json.loads(out.read_text())["decode_tokens_per_s"]["llama.cpp q8_0"] is None


def test_hetserve_on_a_given_gguf(tiny_model, tmp_path):
    """--gguf FILE without llama.cpp: hetserve times the same file, experts on cpu-int4."""
    pytest.importorskip("gguf")
    from hetserve.testing.tiny_gguf import write_gguf

    src = tiny_model("qwen3-moe", overrides={"hidden_size": 256, "moe_intermediate_size": 256,
                                             "head_dim": 64})  # fmt: skip
    gguf = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", experts="q4_K")
    out = tmp_path / "decode.json"
    skips = ["--skip-llamacpp", "--skip-hf", "--skip-reference", "--skip-all-int8"]
    rc = main(["bench", "decode", "--model", str(src), *FAST, *skips, "--gguf", str(gguf),
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["decode_tokens_per_s"]["hetserve gguf (same GGUF)"] > 0
    assert data["llamacpp_peer"] == "llama.cpp gguf"


def test_bench_decode_on_a_gguf_file_alone(tiny_model, tmp_path):
    """--model FILE.gguf, as people download it (no HF directory): the config from the file's
    metadata, only the file's rows (llama.cpp skipped here: hetserve on the file)."""
    pytest.importorskip("gguf")
    from hetserve.testing.tiny_gguf_archs import write_family_gguf

    gguf = write_family_gguf(tiny_model("gpt-oss"), tmp_path / "m.gguf", "q8_0")
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(gguf), *FAST, "--skip-llamacpp",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    rates = json.loads(out.read_text())["decode_tokens_per_s"]
    assert list(rates) == ["hetserve gguf (same GGUF)"] and rates["hetserve gguf (same GGUF)"] > 0


def test_bench_decode_streams_rates_and_roofline(moe_dir, tmp_path, capsys):
    out = tmp_path / "streams.json"
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, "--streams", "4,1",
               "--rounds", "2", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["streams"]
    assert [r["streams"] for r in rows] == [1, 4]  # sorted
    assert len(data["rounds_tokens_per_s"]) == 2
    for r in rows:
        best = max(rnd[str(r["streams"])] for rnd in data["rounds_tokens_per_s"])
        assert r["tokens_per_s"] == best > 0
        assert r["fraction_of_roofline"] == pytest.approx(
            r["tokens_per_s"] / r["roofline_tokens_per_s"])  # fmt: skip
    assert rows[0]["vs_one_stream"] == pytest.approx(1.0)
    assert data["peaks"]["read_gbps"] > 0
    # Each round also against the bandwidth its own probes showed around it: per round the
    # rate, the probes' best and the fraction of the roofline at that bandwidth; the median.
    from hetserve.bench.decode_streams import step_roofline

    cfg = json.loads((moe_dir / "config.json").read_text())
    gops = {k: data["peaks"]["gops"].get(k) for k in ("int8", "int16")}
    for r in rows:
        own = r["rounds_own_probes"]
        assert [o["tokens_per_s"] for o in own] == [
            rnd[str(r["streams"])] for rnd in data["rounds_tokens_per_s"]]  # fmt: skip
        for o in own:
            roof = step_roofline(cfg, r["streams"], o["read_gbps"], gops)
            assert o["read_gbps"] > 0
            assert o["fraction_of_roofline"] == pytest.approx(
                o["tokens_per_s"] / roof["roofline_tokens_per_s"])  # fmt: skip
        fractions = sorted(o["fraction_of_roofline"] for o in own)
        assert r["fraction_own_probes"] == pytest.approx(sum(fractions) / 2)  # two rounds
    text = capsys.readouterr().out
    assert "of roofline" in text and "peaks on" in text and "own probes" in text


def test_step_roofline_by_hand():
    from hetserve.bench.decode_streams import step_roofline

    cfg = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
           "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
           "head_dim": 16, "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
    dense = 2 * (2 * 64 * 64 + 2 * 64 * 32) + 2 * 8 * 64 + 100 * 64  # attention, router, head
    one = step_roofline(cfg, 1, read_gbps=1.0, gops={"int8": 1.0, "int16": None})
    assert one["active_experts_per_layer"] == pytest.approx(2.0)  # one token: its top-k
    assert one["step_bytes"] == pytest.approx(2 * 2 * 6656 + dense)
    assert one["step_ops"] == 2 * (2 * 2 * 3 * 64 * 32 + dense)
    assert one["bandwidth_tokens_per_s"] == pytest.approx(1e9 / one["step_bytes"])
    assert set(one["compute_tokens_per_s"]) == {"int8"}
    # 8 tokens: 8 (1 - (6/8)^8) ~ 7.2 experts of 8 per layer; bytes grow less than 8x, ops 8x
    many = step_roofline(cfg, 8, read_gbps=1.0, gops={"int8": 1.0})
    assert many["active_experts_per_layer"] == pytest.approx(8 * (1 - 0.75**8))
    assert many["step_ops"] == 8 * one["step_ops"]
    assert many["roofline_tokens_per_s"] == min(
        many["bandwidth_tokens_per_s"], many["compute_tokens_per_s"]["int8"])  # fmt: skip


def test_bad_streams_exit_2(moe_dir, capsys):
    rc = main(["bench", "decode", "--model", str(moe_dir), "--streams", "0,x"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--streams" in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="all-int8 rows run on CPU-only machines")
def test_bench_decode_one_all_int8_row_per_kv_cache_dtype(moe_dir, tmp_path):
    out = tmp_path / "decode.json"
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, "--skip-llamacpp", "--skip-hf",
               "--skip-reference", "--skip-cpu-int8", "--kv-cache-dtypes", "float32,int8",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rates = data["decode_tokens_per_s"]
    assert list(rates) == ["hetserve all-int8 kv=float32", "hetserve all-int8 kv=int8"]
    assert all(r > 0 for r in rates.values())
    err = data["kv_logprob_error_vs_float32"]
    assert list(err) == ["int8"] and 0 < err["int8"]["mean"] <= err["int8"]["max"] < 1.0


def test_bad_kv_cache_dtypes_exit_2(moe_dir, capsys):
    rc = main(["bench", "decode", "--model", str(moe_dir), "--kv-cache-dtypes", "int4"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--kv-cache-dtypes" in err and "\n" not in err


def test_bench_decode_numa_both_on_a_fake_two_node_tree(moe_dir, tmp_path, monkeypatch, capsys):
    for node in (0, 1):  # node 0 -> CPU 0, node 1 -> CPU 1 (this machine has one real node)
        (tmp_path / "nodes" / f"node{node}").mkdir(parents=True)
        (tmp_path / "nodes" / f"node{node}" / "cpulist").write_text(f"{node}\n")
    monkeypatch.setenv("HETSERVE_NUMA_SYSFS", str(tmp_path / "nodes"))
    out = tmp_path / "decode.json"
    skips = ["--skip-llamacpp", "--skip-hf", "--skip-reference", "--skip-all-int8"]
    rc = main(["bench", "decode", "--model", str(moe_dir), *FAST, *skips, "--numa", "both",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {"hetserve cpu-int8", "hetserve cpu-int8 numa=auto"}
    assert set(data["decode_tokens_per_s"]) == rows
    assert data["numa_auto_vs_off"]["hetserve cpu-int8"] > 0
    assert "--numa auto / off" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a bad value: argparse's one line, exit 2
        main(["bench", "decode", "--model", str(moe_dir), "--numa", "on"])
    assert exc.value.code == 2
