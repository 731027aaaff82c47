"""What `bench serve` learns about the served model, and the token ids it then draws."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetserve.bench.model_facts import (
    FIRST_SAFE_TOKEN_ID,
    TokenSpace,
    learn_model_facts,
    require_vocab,
    tokenizer_facts,
)
from hetserve.bench.server_info import parse_prometheus
from hetserve.errors import InvalidInputError


def test_tokenizer_dir_of_a_real_checkpoint(tiny_model) -> None:
    model = tiny_model("qwen3-moe")
    config = json.loads((model / "config.json").read_text())
    facts = tokenizer_facts(str(model))
    # The model's embedding rows (576) and the tokenizer's own tokens: 512 trained, six markers
    # for tools and thinking past them, Qwen's four fill-in-the-middle specials (the rows
    # beyond are padding to a multiple of 64).
    assert facts.vocab_size == config["vocab_size"] == 576
    assert facts.max_position_embeddings == config["max_position_embeddings"]
    # The ChatML specials of the tiny tokenizer (0-2), eos and pad among them, and the FIM ones.
    assert facts.special_ids == {0, 1, 2, 518, 519, 520, 521}
    assert facts.tokenizer_vocab == 522
    # A tokenizer.json given as a file: no config.json, the tokenizer's own size.
    alone = tokenizer_facts(str(model / "tokenizer.json"))
    assert (alone.vocab_size, alone.max_position_embeddings) == (522, None)


def test_specials_from_every_source_are_avoided(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 40, "eos_token_id": [30, 31], "bos_token_id": 39})
    )
    decoder = {"35": {"content": "<x>", "special": True}, "36": {"content": "y", "special": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    facts = tokenizer_facts(str(tmp_path))
    assert facts.special_ids == {30, 31, 35, 39} and facts.vocab_size == 40
    space = TokenSpace(40, facts.special_ids)
    drawn = space.draw(np.random.default_rng(0), 5000)
    assert set(drawn.tolist()) == set(range(40)) - {30, 31, 35, 39}  # every other id, low ones too


def test_unknown_specials_keep_clear_of_the_lowest_ids() -> None:
    drawn = TokenSpace(50).draw(np.random.default_rng(0), 5000)
    assert drawn.min() == FIRST_SAFE_TOKEN_ID and drawn.max() == 49
    with pytest.raises(InvalidInputError, match="special"):
        TokenSpace(3, frozenset({0, 1, 2}))


def test_bad_tokenizer_dirs_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="no config.json or tokenizer.json"):
        tokenizer_facts(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="not readable JSON"):
        tokenizer_facts(str(tmp_path))


def test_precedence_explicit_then_server_then_tokenizer(fake_server, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 300, "max_position_embeddings": 2048})
    )
    server = fake_server(card={"id": "fake", "vocab_size": 200})
    facts = learn_model_facts(server.url, "fake", tokenizer=str(tmp_path))
    assert (facts.vocab_size, facts.max_model_len) == (200, 2048)
    assert facts.sources == {
        "vocab_size": "server /v1/models",
        "max_model_len": f"--tokenizer {tmp_path}",
    }
    facts = learn_model_facts(server.url + "/v1", "fake", vocab_size=100, max_model_len=64)
    assert (facts.vocab_size, facts.max_model_len, facts.special_ids) == (100, 64, None)
    assert "vocabulary 100 (--vocab-size)" in facts.notes()[0]


def test_missing_vocab_names_the_fix(fake_server) -> None:
    server = fake_server(card={"id": "fake", "max_model_len": 4096})  # as vLLM reports it
    facts = learn_model_facts(server.url, "fake")
    assert facts.max_model_len == 4096
    with pytest.raises(InvalidInputError, match="--tokenizer DIR .* or --vocab-size N"):
        require_vocab(facts, server.url, "fake")
    with pytest.raises(InvalidInputError, match="serves 'fake', not 'other'"):
        require_vocab(learn_model_facts(server.url, "other"), server.url, "other")
    bare = fake_server(card=None)  # no /v1/models route at all
    assert learn_model_facts(bare.url, "fake").vocab_size is None


def test_unreachable_server_is_a_user_error(fake_server) -> None:
    server = fake_server()
    server.stop()
    with pytest.raises(InvalidInputError, match="cannot reach .*is the server up"):
        learn_model_facts(server.url, "fake")


def test_prometheus_text_sums_labelled_samples() -> None:
    text = (
        "# HELP hetserve_kv_blocks_used KV blocks in use\n# TYPE hetserve_kv_blocks_used gauge\n"
        "hetserve_kv_blocks_used 3.0\n"
        'hetserve_requests_total{finish_reason="stop"} 2.0\n'
        'hetserve_requests_total{finish_reason="a } b"} 5.0\n'
        "vllm:num_requests_running 1\nprocess_resident_memory_bytes 1.5e+08\n"
        "garbage line\nnan_metric NaN\n"
    )
    assert parse_prometheus(text) == {
        "hetserve_kv_blocks_used": 3.0,
        "hetserve_requests_total": 7.0,
        "vllm:num_requests_running": 1.0,
        "process_resident_memory_bytes": 1.5e8,
    }
