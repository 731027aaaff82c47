"""Workloads: trace blocks, requested lengths, prefix sharing, --max-model-len fitting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.serve.client import build_payload
from hetserve.bench.serve.datasets import multiturn_workload, random_workload, sharegpt_workload
from hetserve.bench.serve.trace import trace_workload
from hetserve.bench.serve.workload import BenchRequest, BlockTokens, fit_lengths
from hetserve.errors import InvalidInputError

MOONCAKE = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")


def _write_trace(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]},
    {"timestamp": 900, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
]


def test_trace_prompts_have_requested_lengths_and_shared_blocks(tmp_path: Path) -> None:
    w = trace_workload(_write_trace(tmp_path / "t.jsonl", TRACE), None, TokenSpace(5000))
    reqs = [c[0] for c in w.conversations]
    bt = w.block_tokens
    assert bt is not None and bt.block_size == 512
    prompts = [bt.prompt(r.hash_ids, r.prompt_len) for r in reqs]
    assert [len(p) for p in prompts] == [1100, 700, 1024]
    assert [r.output_len for r in reqs] == [7, 3, 5]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.9]
    # Same id at the same position -> same tokens; a different id -> different tokens.
    assert prompts[0][:512] == prompts[1][:512] == prompts[2][:512]
    assert prompts[0][512:1024] == prompts[2][512:1024]
    assert prompts[1][512:700] != prompts[0][512:700]
    assert all(10 <= t < 5000 for p in prompts for t in p)


def test_trace_blocks_depend_only_on_the_id() -> None:
    a, b = BlockTokens(512, TokenSpace(32000)), BlockTokens(512, TokenSpace(32000))
    assert np.array_equal(a.block(42), b.block(42))
    assert not np.array_equal(a.block(42), a.block(43))
    assert len(a.block(7)) == 512
    with pytest.raises(ValueError, match="blocks"):
        a.prompt([1], 513)  # more tokens than its ids cover


def test_trace_payload_sends_token_ids_with_max_tokens_and_ignore_eos(tmp_path: Path) -> None:
    w = trace_workload(_write_trace(tmp_path / "t.jsonl", TRACE), 1, TokenSpace(5000))
    body = build_payload("/v1/completions", "m", w.conversations[0][0], None, w, True)
    assert len(body["prompt"]) == 1100 and all(isinstance(t, int) for t in body["prompt"])
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_perfect_cache_reuse_counts_seen_blocks(tmp_path: Path) -> None:
    w = trace_workload(_write_trace(tmp_path / "t.jsonl", TRACE), None, TokenSpace(5000))
    reuse = w.prefix_reuse
    # Blocks: [0,1,2] all new; [0,3]: 0 hit; [0,1]: both hit.
    assert (reuse["blocks_total"], reuse["blocks_hit"]) == (7, 3)
    assert reuse["prompt_tokens_hit"] == 512 + 512 + 512
    assert reuse["prompt_tokens_total"] == 1100 + 700 + 1024


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="shared Mooncake trace not present")
def test_mooncake_trace_perfect_cache_ratio_matches_its_readme() -> None:
    w = trace_workload(str(MOONCAKE), None, TokenSpace(32000))
    assert w.num_requests == 3993
    # The README says about 65% of blocks hit with an unbounded cache (the paper: 66%).
    assert 0.60 < w.prefix_reuse["block_hit_ratio"] < 0.70


def test_trace_clip_keeps_leading_blocks_and_counts_changes(tmp_path: Path) -> None:
    w = trace_workload(
        _write_trace(tmp_path / "t.jsonl", TRACE), None, TokenSpace(5000), max_model_len=800
    )
    reqs = [c[0] for c in w.conversations]
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(793, 7), (700, 3), (795, 5)]
    assert any("changed 2 of 3" in n for n in w.notes)
    assert all(r.prompt_len + r.output_len <= 800 for r in reqs)


def test_trace_scale_shrinks_blocks_and_keeps_sharing(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", TRACE)
    w = trace_workload(path, None, TokenSpace(5000), max_model_len=300, fit_mode="scale")
    bt, reqs = w.block_tokens, [c[0] for c in w.conversations]
    assert bt.block_size == math.floor(512 * 300 / 1107)
    assert all(r.prompt_len + r.output_len <= 300 for r in reqs)
    prompts = [bt.prompt(r.hash_ids, r.prompt_len) for r in reqs]
    assert prompts[0][: bt.block_size] == prompts[1][: bt.block_size]
    assert any("changed 3 of 3" in n for n in w.notes)


def test_bad_trace_lines_are_user_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(InvalidInputError, match="line 1"):
        trace_workload(str(bad), None, TokenSpace(100))
    too_long = [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}]
    with pytest.raises(InvalidInputError, match="exceeds"):
        trace_workload(_write_trace(tmp_path / "long.jsonl", too_long), None, TokenSpace(100))
    with pytest.raises(InvalidInputError, match="not found"):
        trace_workload(str(tmp_path / "missing.jsonl"), None, TokenSpace(100))


def test_random_lengths_ranges_and_shared_prefix() -> None:
    w = random_workload(
        200, 100, 20, range_ratio=0.5, prefix_ratio=0.4, space=TokenSpace(300), seed=1
    )
    reqs = [c[0] for c in w.conversations]
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(len(r.token_ids) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # a real range, not one value
    shortest = min(r.prompt_len for r in reqs)
    prefix = reqs[0].token_ids[: int(shortest * 0.4)]
    assert all(r.token_ids[: len(prefix)] == prefix for r in reqs)
    assert reqs[0].token_ids[len(prefix) :] != reqs[1].token_ids[len(prefix) :]
    again = random_workload(200, 100, 20, 0.5, 0.4, TokenSpace(300), seed=1)
    assert again.conversations[5][0].token_ids == reqs[5].token_ids  # seeded


def test_fit_lengths_clip_and_scale() -> None:
    reqs = [BenchRequest(100, 10), BenchRequest(1000, 500), BenchRequest(300, 900)]
    notes = fit_lengths(reqs, 512, "clip")
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(100, 10), (256, 256), (256, 256)]
    assert "changed 2 of 3" in notes[0]
    reqs = [BenchRequest(100, 10), BenchRequest(1000, 500)]
    notes = fit_lengths(reqs, 150, "scale")
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(10, 1), (100, 50)]
    assert "changed 2 of 2" in notes[0]


def test_sharegpt_takes_first_exchange(tmp_path: Path) -> None:
    convs = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "x" * 80},
                {"from": "gpt", "value": "y" * 40},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "gpt", "value": "opens with the model"},
                {"from": "human", "value": "q" * 80},
            ],
        },
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    w = sharegpt_workload(str(path), 10, None, None, seed=0)
    assert w.num_requests == 1
    r = w.conversations[0][0]
    assert (r.text, r.prompt_len, r.output_len) == ("x" * 80, 20, 10)
    assert any("estimated" in n for n in w.notes)
    assert any("only 1 usable" in n for n in w.notes)
    with pytest.raises(InvalidInputError, match="not JSON"):
        (tmp_path / "bad.json").write_text("{nope")
        sharegpt_workload(str(tmp_path / "bad.json"), 10, None, None, 0)


def test_multiturn_conversations_have_turns() -> None:
    w = multiturn_workload(3, turns=4, user_len=16, output_len=8, path=None, tokenizer=None, seed=0)
    assert [len(c) for c in w.conversations] == [4, 4, 4]
    assert all(len(r.text.split()) == 16 and r.output_len == 8 for c in w.conversations for r in c)


def test_multiturn_max_model_len_drops_turns_that_no_longer_fit() -> None:
    w = multiturn_workload(
        2, turns=4, user_len=30, output_len=20, path=None, tokenizer=None, seed=0, max_model_len=120
    )
    assert [len(c) for c in w.conversations] == [2, 2]  # 50 + 50 fit, a third turn would not
    assert any("cut turns from 2 conversations" in n for n in w.notes)
    tiny = multiturn_workload(
        1, turns=2, user_len=30, output_len=20, path=None, tokenizer=None, seed=0, max_model_len=40
    )
    (first,) = tiny.conversations[0]
    assert (first.prompt_len, first.output_len) == (20, 20)
    assert len(first.text) < len(w.conversations[0][0].text)  # the text was cut too
    with pytest.raises(InvalidInputError, match="--multiturn-user-len"):
        multiturn_workload(1, 2, 0, 8, None, None, 0)
