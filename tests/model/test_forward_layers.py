"""`forward_layers` (a layer slice's forward) gives the numbers `forward` gives: a prompt chunk
run through the decoder layers in pieces, its K/V written layer by layer, equals the chunk in
one pass, after no context and after a cached one, on every attention kind the families have
(GQA, MLA, alternating sliding windows) and on the int8 kernels."""

import pytest
import torch

from hetserve import LLM
from hetserve.engine.runner import SeqInput


def _pieces(runner, tokens, computed, blocks, cuts):
    hidden = None
    for a, b in zip(cuts, cuts[1:], strict=False):
        hidden = runner.forward_layers(SeqInput(tokens, computed, blocks), a, b, hidden)
    return hidden


@pytest.mark.parametrize(
    "family,placement",
    [
        ("llama", "device"),
        ("qwen3-moe", "device"),
        ("qwen3-moe", "all-int8"),
        ("deepseek-v3", "device"),
        ("gpt-oss", "device"),
    ],
)
def test_a_chunk_in_layer_pieces_equals_one_pass(tiny_model, family, placement):
    llm = LLM(tiny_model(family), placement=placement, max_model_len=256)
    runner = llm.engine.runner
    layers = len(runner.model.model.layers)
    cuts = [0, 1, *range(2, layers + 1)] if layers > 2 else [0, 1, layers]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 400, (40,), generator=g).tolist()
    one, pieces = [0, 1, 2], [3, 4, 5]  # two copies of the cache, three blocks each
    # A first chunk of 24 tokens, then 16 after it (a cached context).
    whole_a = runner.forward([SeqInput(prompt[:24], 0, one)])
    part_a = _pieces(runner, prompt[:24], 0, pieces, cuts)
    whole_b = runner.forward([SeqInput(prompt[24:], 24, one)])
    part_b = _pieces(runner, prompt[24:], 24, pieces, cuts)
    torch.testing.assert_close(part_a, whole_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(part_b, whole_b, rtol=0, atol=1e-6)
    # Each piece wrote its layers' K/V: the caches agree slot for slot.
    parts = runner.kv.parts()
    assert parts
    bs = runner.block_size  # the parts are indexed by slot: block b holds [b * bs, b * bs + bs)
    for t in parts:
        torch.testing.assert_close(t[3 * bs : 3 * bs + 40], t[:40], rtol=0, atol=1e-6)
    llm.close()


def test_a_slice_after_the_first_layer_needs_its_hidden_states(tiny_model):
    llm = LLM(tiny_model("llama"), placement="device", max_model_len=256)
    with pytest.raises(AssertionError, match="continues from its hidden states"):
        llm.engine.runner.forward_layers(SeqInput([5, 6, 7], 0, [0]), 1, 2, None)
    llm.close()
