"""Kimi-K2: a DeepseekV3ForCausalLM checkpoint with Moonshot's tiktoken-format tokenizer.

The reference tokenizer is `tiktoken.Encoding` built here from the directory's files (ranks
parsed by hand, Kimi's published split pattern, the special-token layout of its
tokenization_kimi.py): what the model was trained with. The reference model is transformers'
DeepseekV3ForCausalLM. The directory's tokenization_kimi.py raises on import, so every test
also shows that hetserve never runs it.
"""

import base64
import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetserve import LLM, SamplingParams
from hetserve.errors import ModelLoadError
from hetserve.model.tokenizer import Tokenizer
from hetserve.testing import make_tiny_checkpoint
from hetserve.testing.tiny_tiktoken import KIMI_SPECIAL_OFFSETS, NUM_RANKS

tiktoken = pytest.importorskip("tiktoken")
transformers = pytest.importorskip("transformers")

# tokenization_kimi.py's pat_str, written out as published.
PUBLISHED_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED = 256
TEXTS = [
    "",
    "Hello World! it's THEY'RE we'LL I'D",
    "你好世界，模型专家注意力缓存。東京タワーへ行こう",
    "naïve café Zürich — señor Привет мир 한국어 e\u0301 ﬁ",
    "emoji 😀🚀👍🏽 and 🇫🇷 flags",
    "numbers 1 12 123 1234 1234567 3.14159 -42 1e10",
    "whitespace   runs\n\n\n\tand\r\n  trailing   ",
    "code: def f(x): return x**2 -> {a: [1, 2]} <html></html> ::= &&",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] <|reserved_token_500|> <|im_end <|not_special|> [PAD][UNK]",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return make_tiny_checkpoint("kimi-k2", tmp_path_factory.mktemp("kimi"), lm_head_scale=4.0)


@pytest.fixture(scope="module")
def reference(kimi_dir):
    """(tiktoken.Encoding as Kimi's tokenizer builds it, its special ids)."""
    ranks = {}
    for line in (kimi_dir / "tiktoken.model").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    base = len(ranks)
    decoder = json.loads((kimi_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    named = {int(i): entry["content"] for i, entry in decoder.items()}
    ids = range(base, base + NUM_RESERVED + 2)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    enc = tiktoken.Encoding(
        "kimi-ref", pat_str=PUBLISHED_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    return enc, set(specials.values())


@pytest.fixture(scope="module")
def tok(kimi_dir):
    return Tokenizer(kimi_dir)


def assert_same(tok, reference, text: str) -> None:
    enc, special = reference
    ids = tok.encode(text)
    assert ids == enc.encode(text, allowed_special="all"), text
    assert tok.decode(ids, skip_special_tokens=False) == enc.decode(ids) == text
    assert tok.decode(ids) == enc.decode([i for i in ids if i not in special])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_tiktoken(tok, reference, text):
    assert_same(tok, reference, text)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=60))
def test_encode_decode_equal_tiktoken_on_random_text(tok, reference, text):
    assert_same(tok, reference, text)


def test_very_long_runs_are_cut_as_kimi_cuts_them(tok, reference):
    """Kimi encodes runs of (non-)whitespace longer than 25,000 characters in pieces."""
    enc, _ = reference
    # The cut inside the first run splits a token ("serves" * 5000 is one pre-token).
    text = "serves" * 5_000 + " " * 30_000 + "你好" * 13_000 + "x"
    expected = []
    for piece in kimi_pieces(text, 25_000):
        expected += enc.encode(piece, allowed_special="all")
    ids = tok.encode(text)
    assert ids == expected and ids != enc.encode(text, allowed_special="all")
    assert tok.decode(ids) == text


def kimi_pieces(s: str, limit: int):
    """Kimi's rule, written as a character loop: a new piece starts where a run of whitespace
    or of non-whitespace would exceed `limit` characters."""
    start, run, space = 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            run, space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def test_special_token_layout_and_eos(tok):
    ids = {name: NUM_RANKS + offset for name, offset in KIMI_SPECIAL_OFFSETS.items()}
    for name, i in ids.items():
        assert tok.token_to_id(name) == i and tok.id_to_token(i) == name
    assert tok.token_to_id(f"<|reserved_token_{NUM_RANKS + 5}|>") == NUM_RANKS + 5
    assert tok.vocab_size == NUM_RANKS + NUM_RESERVED + 2
    assert tok.eos_token_ids == (ids["<|im_end|>"], ids["[EOS]"])
    for i in range(tok.vocab_size):
        assert tok.token_to_id(tok.id_to_token(i)) == i


def test_chat_template_and_generation_through_llm(kimi_dir, reference):
    enc, _ = reference
    llm = LLM(kimi_dir, placement="device")
    messages = [{"role": "user", "content": "Hi, 你好!"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    assert prompt == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|><|im_user|>user<|im_middle|>Hi, 你好!<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = llm.tokenizer.apply_chat_template(messages, tools=tools)
    assert (
        with_tools
        == f"<|im_system|>tool_declare<|im_middle|>{json.dumps(tools)}<|im_end|>" + prompt
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.chat(messages, params)[0]
    assert out.prompt_token_ids == enc.encode(prompt, allowed_special="all")
    assert out.prompt_token_ids[0] == NUM_RANKS + KIMI_SPECIAL_OFFSETS["<|im_system|>"]
    assert len(out.token_ids) == 6
    assert_streamed_text(out.text, llm.tokenizer.decode(out.token_ids))
    out = llm.generate("Hello 世界", params)[0]
    assert out.prompt_token_ids == enc.encode("Hello 世界")
    assert_streamed_text(out.text, enc.decode([i for i in out.token_ids if i < NUM_RANKS]))


def assert_streamed_text(streamed: str, full: str) -> None:
    """The detokenizer holds back a trailing incomplete UTF-8 character (U+FFFD)."""
    assert full.startswith(streamed) and not full[len(streamed) :].strip("\ufffd")


def test_published_config_loads_and_matches_transformers_deepseek_v3(kimi_dir, tmp_path):
    """config.json as Kimi-K2 publishes it: model_type kimi_k2, auto_map to remote code (which
    must not run), old-style rope_scaling; hetserve's logprobs equal transformers' DeepseekV3."""
    path = tmp_path / "kimi-published"
    shutil.copytree(kimi_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(
        model_type="kimi_k2",
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        aux_loss_alpha=0.001,
        moe_layer_freq=1,
        seq_aux=True,
        pretraining_tp=1,
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        shutil.copy(path / "tokenization_kimi.py", path / name)  # the same tripwire
    config = transformers.DeepseekV3Config.from_dict({**cfg, "model_type": "deepseek_v3"})
    assert config.rope_parameters["rope_type"] == "yarn"
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32
    ).eval()
    llm = LLM(path, placement="device")
    ids = llm.tokenizer.encode("Kimi 你好 world, 1234! " * 8)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1, logprobs=0, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    full = ids + out.token_ids
    with torch.no_grad():
        logp = ref(torch.tensor([full])).logits[0].log_softmax(-1)[:-1]
    expected = logp.gather(1, torch.tensor(full[1:]).view(-1, 1))[:, 0]
    entries = out.prompt_logprobs[1:] + out.logprobs
    ours = torch.tensor([e[t].logprob for e, t in zip(entries, full[1:], strict=True)])
    err = (ours - expected).abs().max().item()
    print(f"kimi-k2 published config: prompt+decode max |err| {err:.2e}")
    assert err <= 1e-4


def test_stale_tiktoken_cache_is_not_used(kimi_dir, tmp_path):
    """tiktoken caches files by path; a changed tiktoken.model at the same path is re-read."""
    path = tmp_path / "tok"
    path.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(kimi_dir / name, path / name)
    before = Tokenizer(path).encode("hello")
    lines = (path / "tiktoken.model").read_bytes().splitlines()
    (path / "tiktoken.model").write_bytes(b"\n".join(lines[:256]) + b"\n")  # bytes only
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        str(256 + offset): {"content": name} for name, offset in KIMI_SPECIAL_OFFSETS.items()
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    after = Tokenizer(path).encode("hello")
    assert len(after) == 5 and after != before


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda c: c.update(tokenizer_class="Foo", auto_map={}), "TikTokenTokenizer"),
        (lambda c: c["added_tokens_decoder"].update({"7": {"content": "x"}}), "added token '7'"),
    ],
)
def test_tiktoken_directories_we_do_not_understand_are_refused(kimi_dir, tmp_path, change, match):
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(kimi_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    change(cfg)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        Tokenizer(tmp_path)


def test_missing_tiktoken_package_is_a_one_line_error(kimi_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tiktoken", None)
    with pytest.raises(ModelLoadError, match="pip install tiktoken"):
        Tokenizer(kimi_dir)


def test_transformers_tiktoken_converter_with_kimis_pattern_agrees(tok, kimi_dir):
    """A second reference: transformers cannot load the directory without running its remote
    code (auto_map), but its own tiktoken -> tokenizers converter, given Kimi's pattern and
    special tokens, produces the same ids on these texts."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    specials = [tok.id_to_token(i) for i in range(NUM_RANKS, NUM_RANKS + NUM_RESERVED + 2)]
    fast = convert.TikTokenConverter(
        vocab_file=str(kimi_dir / "tiktoken.model"),
        pattern=PUBLISHED_PATTERN,
        extra_special_tokens=specials,
    ).converted()
    for text in TEXTS:
        assert fast.encode(text).ids == tok.encode(text), text


def test_long_text_path_and_length_bound(tok, reference):
    # The server tokenizes long prompts with encode_long (on a worker thread) and first bounds
    # the token count by max_token_chars: both must hold for the tiktoken backend too.
    text = "Kimi tokenizes long texts too. 長い文章も。 " * 400
    ids = tok.encode_long(text, add_special_tokens=False)
    enc, _ = reference
    assert ids == enc.encode(text, allowed_special="all")
    assert len(text) / tok.max_token_chars <= len(ids)
