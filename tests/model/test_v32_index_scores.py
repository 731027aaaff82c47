"""DeepSeek-V3.2's indexer at decode on the native kernel (native/mla_decode.c): every key
read in place from the paged cache against the torch path's gathered keys and einsums, for
fp32, fp16 and int8 caches; contexts longer than index_topk so the selection matters."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.model.deepseek_v32 import IndexedMLAttention
from hetserve.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_native_index_scores_equal_torchs(tiny_model, kv_dtype, monkeypatch):
    path = tiny_model("deepseek-v3.2", lm_head_scale=8.0)
    prompts = [list(range(10, 50)), list(range(60, 83)), list(range(5, 9))]  # topk is 16
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    opts = {"placement": "device", "dtype": "float32", "kv_cache_dtype": kv_dtype}
    native = IndexedMLAttention._native_scores
    checked = []

    def compared(self, iq, iw, ctx, n):
        got = native(self, iq, iw, ctx, n)
        d = ctx.meta.decode
        b = d.tables.shape[0]
        keys = ctx.kv.rows(self.layer_idx, 1, d.slots.flatten(), iq.dtype).view(b, n, -1)
        want = self.indexer.scores(iq.unsqueeze(1), iw.unsqueeze(1), keys).squeeze(1)
        want = want.masked_fill(~d.mask.view(b, n), float("-inf"))
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        checked.append(b)
        return got

    monkeypatch.setattr(IndexedMLAttention, "_native_scores", compared)
    got = LLM(path, **opts).generate(prompt_token_ids=prompts, sampling_params=params)
    assert len(checked) >= 5 and max(checked) == 3
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    monkeypatch.setattr(IndexedMLAttention, "_native_scores", native)
    want = LLM(path, **opts).generate(prompt_token_ids=prompts, sampling_params=params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        lg = [next(iter(s.values())).logprob for s in g.logprobs]
        lw = [next(iter(s.values())).logprob for s in w.logprobs]
        torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=0, atol=1e-4)
