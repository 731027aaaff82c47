"""Greedy output equal to llama.cpp's on the same Q8_0 file (issue 38), under the placement a
GPU-less machine gets (all-int8: experts and every linear on the file's q8_0 numbers) and
in fp32 (device). Architectures: qwen3moe, the one whose tiny file (testing/tiny_gguf.py)
llama.cpp both loads and follows token for token here. mixtral's tiny Q8_0 file leaves
llama.cpp's path at the 4th token on a near-tie: transformers on the file's own numbers puts the
top two 0.0055 nats apart there, while llama.cpp's q8_0 rounding of activations moves its
logprobs by ~0.035 (with f32 non-expert tensors the first 8 tokens agree); qwen2moe's file is
refused by llama.cpp."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from hetserve import LLM, SamplingParams  # noqa: E402
from hetserve.native import native_unavailable_reason  # noqa: E402
from hetserve.testing.tiny_gguf import write_gguf  # noqa: E402

from .test_gguf import SHAPE  # noqa: E402

STEPS = 24


@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
@pytest.mark.parametrize("placement", ["all-int8", "device"])
def test_greedy_equals_llama_cpp_on_a_q8_0_file(tiny_model, tmp_path, placement):
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q8_0", "q8_0")
    ids = torch.randint(10, 400, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    peer = llama_cpp.Llama(str(path), n_ctx=128, verbose=False, n_threads=2)
    try:
        theirs = []
        for token in peer.generate(ids, temp=0.0, top_k=1, reset=True):
            theirs.append(token)
            if len(theirs) == STEPS:
                break
    finally:
        peer.close()
    llm = LLM(str(path), placement=placement, device="cpu")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    assert list(out.outputs[0].token_ids) == theirs
