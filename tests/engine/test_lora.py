"""Serving LoRA adapters: a served adapter equals the merged model (fp32: logprobs to 1e-4 and the
same greedy tokens), adapters and the base share batches and give what they give alone, and no
KV is shared across adapters while one adapter's prefixes hit."""

import shutil

import pytest

from hetserve import LLM, SamplingParams
from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.core.request import NewRequest
from hetserve.errors import InvalidInputError
from hetserve.model.export import export_merged
from hetserve.model.lora_adapter import read_adapter
from tests.lora_util import prompt_logprobs, run, sample_logprobs, write_random_adapter

# Which linears each family's adapter covers: attention everywhere; DeepSeek also its dense
# first layer and shared experts (and rsLoRA); Llama its MLPs, with per-module rank and alpha.
ADAPTERS = {
    "qwen3-moe": {"match": r"self_attn"},
    # Hybrid: the gated full attention and the Gated DeltaNet layers' projections.
    "qwen3-next": {"match": r"self_attn|linear_attn"},
    "deepseek-v3": {"match": r"self_attn|layers\.0\.mlp|shared_experts", "use_rslora": True},
    "llama": {
        "match": r"self_attn|mlp",
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"o_proj": 3},
    },
}
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=1, prompt_logprobs=0, ignore_eos=True)
PROMPTS = [list(range(5, 42)), list(range(100, 120))]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    made = {}

    def get(family, seed=1, **kw):
        key = (family, seed, repr(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"lora_{family}")
            made[key] = write_random_adapter(tiny_model(family), out, seed=seed, **kw)
        return made[key]

    return get


def merged(base, adapter, tmp_path):
    return export_merged(base, adapter, tmp_path / "merged", progress=False)


def assert_same(outs, refs, tol=1e-4):
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert (prompt_logprobs(out) - prompt_logprobs(ref)).abs().max() <= tol
        assert (sample_logprobs(out) - sample_logprobs(ref)).abs().max() <= tol


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_served_adapter_equals_merged_model(tiny_model, adapters, tmp_path, family):
    base = tiny_model(family)
    adapter = adapters(family, **ADAPTERS[family])
    served = LLM(base, lora_modules={"a": adapter}, placement="device").engine
    outs = run(served, PROMPTS, PARAMS, ["a", "a"])
    refs = run(
        LLM(merged(base, adapter, tmp_path), placement="device").engine,
        PROMPTS,
        PARAMS,
        [None, None],
    )
    assert_same(outs, refs)
    plain = run(served, PROMPTS[:1], PARAMS, [None])[0]  # the adapter matters
    assert (prompt_logprobs(plain) - prompt_logprobs(outs[0])).abs().max() > 0.1


def test_int8_placement_with_adapter_is_within_int8_error(tiny_model, adapters, tmp_path):
    """Every linear int8 (q/k/v fused into one matrix): the adapter's deltas are exact on top
    of the int8 base, so against the fp32 merged model the error is the int8 base's own; the
    bound is twice what int8 costs the base model against fp32 here."""
    rules = tmp_path / "int8.yaml"
    rules.write_text("rules:\n  - {name: int8, match: '.*', device: cpu, backend: cpu-int8}\n")
    base = tiny_model("llama")
    adapter = adapters("llama", **ADAPTERS["llama"])
    int8 = LLM(base, lora_modules={"a": adapter}, placement=str(rules)).engine
    assert any(getattr(m, "qkv_proj", None) is not None for m in int8.model.modules())
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = [list(range(5, 60))]
    with_lora = prompt_logprobs(run(int8, prompt, params, ["a"])[0])
    int8_base = prompt_logprobs(run(int8, prompt, params, [None])[0])
    fp32_merged = prompt_logprobs(
        run(
            LLM(merged(base, adapter, tmp_path), placement="device").engine, prompt, params, [None]
        )[0]
    )
    fp32_base = prompt_logprobs(
        run(LLM(base, placement="device").engine, prompt, params, [None])[0]
    )
    base_err = (int8_base - fp32_base).abs()
    err = (with_lora - fp32_merged).abs()
    assert err.max() <= 2 * base_err.max() and err.mean() <= 2 * base_err.mean()
    assert (with_lora - int8_base).abs().max() > 10 * base_err.max()  # the adapter is applied


@pytest.mark.parametrize("max_loras", [4, 1])
def test_adapters_and_base_in_one_batch_equal_their_solo_runs(tiny_model, adapters, max_loras):
    """MLA (DeepSeek-V3): kv_b_proj runs on cached rows, per sequence in the decode batch and
    per prefill chunk (a small token budget chunks prompts and mixes them with decodes).
    max_loras=1 makes each step run one forward per adapter, evicting and refilling the slot."""
    base = tiny_model("deepseek-v3")
    a = adapters("deepseek-v3", **ADAPTERS["deepseek-v3"])
    b = adapters("deepseek-v3", seed=2, match=r"kv_b_proj|o_proj", rank=8, alpha=4)
    opts = dict(
        lora_modules={"a": a, "b": b},
        max_loras=max_loras,
        enable_prefix_caching=False,
        max_num_batched_tokens=24,
    )
    engine = LLM(base, **opts, placement="device").engine
    prompts = [list(range(5, 42)), list(range(100, 120)), list(range(7, 30)), list(range(60, 99))]
    loras = ["a", "b", None, "a"]
    together = run(engine, prompts, PARAMS, loras)
    alone = [run(engine, [p], PARAMS, [lo])[0] for p, lo in zip(prompts, loras, strict=True)]
    assert_same(together, alone)
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids


def test_no_prefix_hits_across_adapters_and_hits_within_one(tiny_model, adapters, tmp_path):
    base = tiny_model("qwen3-moe")
    a = adapters("qwen3-moe", **ADAPTERS["qwen3-moe"])
    b = adapters("qwen3-moe", seed=2, match=r"q_proj|v_proj")
    llm = LLM(base, lora_modules={"a": a, "b": b}, placement="device")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2)
    prompt = list(range(5, 45))  # two full 16-token blocks
    first = run(engine, [prompt], params, ["a"])[0]
    assert first.num_cached_tokens == 0
    assert run(engine, [prompt], params, ["a"])[0].num_cached_tokens == 32
    assert run(engine, [prompt], params, ["b"])[0].num_cached_tokens == 0
    assert run(engine, [prompt], params, [None])[0].num_cached_tokens == 0
    # The LoRA id (a hash of the adapter's content) is in every block hash's extra.
    lora_id = read_adapter(a).id
    req = engine.validate(NewRequest("x", prompt, params, lora="a"))
    assert req.lora_id == lora_id and f"lora:{lora_id}" in req.cache_extra
    for h in hash_prefix_blocks(prompt, 16, (f"lora:{lora_id}",), engine.kv.hash_seed):
        assert engine.kv.pool.lookup(h) is not None
    # The same files elsewhere, under another name, after the first name is gone: still hits.
    copy = shutil.copytree(a, tmp_path / "copy")
    engine.lora.unload("a")
    engine.lora.load("a2", copy)
    assert run(engine, [prompt], params, ["a2"])[0].num_cached_tokens == 32
    with pytest.raises(InvalidInputError, match="'a' is not loaded"):
        llm.generate(prompt_token_ids=prompt, lora_request="a")


def test_unloaded_adapter_leaves_once_unused(tiny_model, adapters):
    base = tiny_model("qwen3-moe")
    a = adapters("qwen3-moe", **ADAPTERS["qwen3-moe"])
    engine = LLM(base, lora_modules={"a": a}, max_loras=1, placement="device").engine
    lora_id = engine.lora.resolve("a")
    engine.enqueue(engine.validate(NewRequest("r", PROMPTS[0], PARAMS, lora="a")), stream=False)
    engine.step()
    engine.lora.unload("a")
    assert engine.lora.adapters() == {}
    outs = []
    while engine.has_unfinished():  # the running request finishes with its adapter
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == PARAMS.max_tokens
    engine.step()
    assert not engine.lora.has(lora_id) and engine.lora.resident() == {}


def test_llm_lora_request_as_vllm(tiny_model, adapters):
    from hetserve import LoRARequest

    base = tiny_model("qwen3-moe")
    a = adapters("qwen3-moe", **ADAPTERS["qwen3-moe"])
    llm = LLM(base, enable_lora=True, placement="device")
    params = SamplingParams(temperature=0, max_tokens=4)
    lora = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params,
                        lora_request=LoRARequest("a", 1, str(a)))  # fmt: skip
    named = LLM(base, lora_modules={"a": a}, placement="device").generate(
        prompt_token_ids=PROMPTS, sampling_params=params, lora_request=["a", None]
    )
    assert [o.token_ids for o in lora] == [named[0].token_ids, lora[1].token_ids]
    assert named[1].token_ids != lora[1].token_ids  # the second ran on the base model
    with pytest.raises(InvalidInputError, match="enable_lora=True"):
        LLM(base).generate(prompt_token_ids=PROMPTS[0], lora_request=LoRARequest("a", 1, str(a)))


def test_chat_with_lora_prints_the_reply_and_timings(tiny_model, adapters, monkeypatch, capsys):
    from hetserve.cli import main

    base = tiny_model("qwen3-moe")
    a = adapters("qwen3-moe", **ADAPTERS["qwen3-moe"])
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n\n"))
    argv = ["chat", "--model", str(base), "--lora", str(a), "--max-tokens", "4"]
    assert main([*argv, "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    want = LLM(base, lora_modules={a.name: str(a)}, placement="device").chat(
        [{"role": "user", "content": "hello"}],
        SamplingParams(temperature=0, max_tokens=4),
        lora_request=a.name,
    )[0]
    assert out.startswith(want.text + "\n")
    lines = out.splitlines()[-6:]
    assert [line.split(":")[0] for line in lines] == [
        "prompt eval count", "prompt eval duration", "prompt eval rate",
        "eval count", "eval duration", "eval rate",
    ]  # fmt: skip
    assert lines[0].split()[-2] == str(len(want.prompt_token_ids))
    assert lines[3].split()[-2] == str(len(want.token_ids) - 1)


def test_generate_picks_an_adapter_by_directory_or_name(tiny_model, adapters, capsys):
    """`generate` loaded --lora-modules but had no way to use them, and a prompt after that
    flag was taken as a module ("no prompt given")."""
    import json

    from hetserve.cli import main

    base = tiny_model("qwen3-moe")
    a = adapters("qwen3-moe", **ADAPTERS["qwen3-moe"])
    common = ["generate", "hello", "--model", str(base), "--max-tokens", "6", "--json"]

    def tokens(*extra):
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]

    by_dir = tokens("--lora", str(a))
    assert by_dir == tokens("--lora", "mine", "--lora-modules", f"mine={a}")
    assert by_dir != tokens()
    assert main(["generate", "--model", str(base), "--lora-modules", f"mine={a}", "hi"]) == 2
    assert "put a command's prompts before it" in capsys.readouterr().err
    assert main([*common, "--lora", "nope"]) == 2
    assert "neither an adapter directory nor a name" in capsys.readouterr().err


def test_lora_flags_and_keywords_build_the_same_config():
    import argparse

    from hetserve.config import EngineConfig, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "8"]
    flags = EngineConfig.from_args(parser.parse_args([*argv, "--enable-lora"]))
    keywords = EngineConfig.from_options(
        lora_modules={"a": "/x", "b": "/y"}, max_loras=2, max_lora_rank=8, enable_lora=True
    )
    assert flags == keywords and flags.lora.lora_modules == (("a", "/x"), ("b", "/y"))
    assert not EngineConfig.from_args(parser.parse_args([])).lora.enabled
    with pytest.raises(InvalidInputError, match="'a' is given twice"):
        EngineConfig.from_options(lora_modules=["a=/x", "a=/y"])
