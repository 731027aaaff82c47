"""The gated delta rule (layers/delta_rule.py) against transformers' reference kernels: the
chunked form at any chunk size and the recurrent step give the same outputs and final state,
with one decay per head (Gated DeltaNet) and one per key channel (Kimi Delta Attention)."""

import pytest
import torch

from hetserve.layers.delta_rule import (
    causal_conv,
    chunked_delta_rule,
    conv_step,
    l2_normalize,
    recurrent_step,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
kimi_linear = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

T, H, DK, DV = 150, 3, 8, 6


def inputs(per_channel: bool, decay_scale: float = 2.0):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, H, DK, generator=g), torch.randn(T, H, DK, generator=g)
    v = torch.randn(T, H, DV, generator=g)
    shape = (T, H, DK) if per_channel else (T, H)
    log_decay = -torch.rand(shape, generator=g) * decay_scale
    beta = torch.rand(T, H, generator=g)
    return q, k, v, log_decay, beta


def reference(per_channel, q, k, v, log_decay, beta, state=None):
    fn = (
        kimi_linear.chunk_kimi_delta_attention
        if per_channel
        else qwen3_next.torch_chunk_gated_delta_rule
    )
    out, final = fn(
        q[None], k[None], v[None], g=log_decay[None], beta=beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk", [64, 16, 7, 1])
def test_chunked_matches_reference(per_channel, chunk):
    q, k, v, log_decay, beta = inputs(per_channel)
    ref_out, ref_state = reference(per_channel, q, k, v, log_decay, beta)
    qn, kn = l2_normalize(q) * DK**-0.5, l2_normalize(k)
    out, state = chunked_delta_rule(qn, kn, v, log_decay, beta, torch.zeros(H, DK, DV), chunk)
    torch.testing.assert_close(out, ref_out, atol=5e-6, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=5e-6, rtol=0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_split_sequence_and_recurrent_steps_continue_the_state(per_channel):
    """Prefill chunks that stop anywhere, then one token at a time, equal one pass."""
    q, k, v, log_decay, beta = inputs(per_channel)
    ref_out, ref_state = reference(per_channel, q, k, v, log_decay, beta)
    qn, kn = l2_normalize(q) * DK**-0.5, l2_normalize(k)
    state, outs = torch.zeros(H, DK, DV), []
    for a, b in ((0, 37), (37, 100)):
        out, state = chunked_delta_rule(qn[a:b], kn[a:b], v[a:b], log_decay[a:b], beta[a:b], state)
        outs.append(out)
    batch_state = state[None].clone()
    for t in range(100, T):
        s = slice(t, t + 1)
        outs.append(recurrent_step(qn[s], kn[s], v[s], log_decay[s], beta[s], batch_state))
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=5e-6, rtol=0)
    torch.testing.assert_close(batch_state[0], ref_state, atol=5e-6, rtol=0)


def test_strong_decay_stays_finite():
    """Decays of e^-30 per token: pairwise factors come from log-space differences, never a
    ratio of two exponentials (which would overflow within a chunk)."""
    q, k, v, log_decay, beta = inputs(per_channel=True, decay_scale=30.0)
    ref_out, _ = reference(True, q, k, v, log_decay, beta)
    qn, kn = l2_normalize(q) * DK**-0.5, l2_normalize(k)
    out, state = chunked_delta_rule(qn, kn, v, log_decay, beta, torch.zeros(H, DK, DV))
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out, ref_out, atol=5e-6, rtol=0)


def test_conv_window_continues_across_calls_and_steps():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 5, generator=g), torch.randn(5, 4, generator=g)
    whole, _ = causal_conv(x, None, w)
    first, window = causal_conv(x[:9], None, w)
    second, window = causal_conv(x[9:15], window, w)
    batch_window = window[None].clone()
    steps = [conv_step(x[t : t + 1], batch_window, w) for t in range(15, 20)]
    torch.testing.assert_close(torch.cat([first, second, *steps]), whole, atol=1e-6, rtol=0)
    ref = qwen3_next.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(whole, ref, atol=1e-6, rtol=0)
