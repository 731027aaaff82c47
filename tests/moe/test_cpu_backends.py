"""CPU experts backends against the `torch` reference, and their promised error bounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetserve.moe.experts import ExpertWeights, available_backends, create_backend
from hetserve.quant.quantize import (
    int4_linear_bound,
    int8_linear_bound,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)

E, H, INTER, K = 8, 128, 64, 3
SILU_LIPSCHITZ = 1.1  # max |d silu / dx| = 1.0998


@pytest.fixture(scope="module")
def weights() -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05
    w2 = torch.randn(E, H, INTER, generator=g) * 0.05
    w13[1, 3, 7] = 1.5  # an outlier channel: per-channel scales must contain it
    return ExpertWeights(w13, w2)


def _routing(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    tw = torch.rand(t, K, generator=g)
    return x, tw, ids


def _reference(weights, x, tw, ids):
    return create_backend("torch", weights).forward(x, tw, ids)


def test_registry_lists_cpu_backends():
    for name in ("cpu-fp32", "cpu-int8", "cpu-int4", "kt", "torch"):
        assert name in available_backends()


@pytest.mark.parametrize("kernel", ["auto", "library"])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_fp32_matches_reference(weights, t, kernel):
    x, tw, ids = _routing(t)
    ref = _reference(weights, x, tw, ids)
    out = create_backend("cpu-fp32", weights, kernel=kernel).forward(x, tw, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_default_backend_is_native_fp32_on_cpu_unless_turned_off(weights, monkeypatch):
    from hetserve.moe.experts import default_backend
    from hetserve.native import native_unavailable_reason

    native = native_unavailable_reason() is None
    assert default_backend(weights) == ("cpu-fp32" if native else "torch")
    half = ExpertWeights(weights.w13.bfloat16(), weights.w2.bfloat16())
    assert default_backend(half) == "torch"
    assert default_backend(weights, activation="gelu") == "torch"
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    assert default_backend(weights) == "torch"


def test_same_expert_twice_and_empty_experts(weights):
    # Token 0 picks expert 2 in two slots; tokens 0 and 1 share expert 5; experts 0,1,3,4,6 idle.
    x, _, _ = _routing(2)
    ids = torch.tensor([[2, 2, 5], [5, 7, 2]])
    tw = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    ref = _reference(weights, x, tw, ids)
    out = create_backend("cpu-fp32", weights).forward(x, tw, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_zero_tokens_and_dtype_round_trip(weights):
    b = create_backend("cpu-int8", weights)
    empty = b.forward(torch.zeros(0, H), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.long))
    assert empty.shape == (0, H)
    x, tw, ids = _routing(3)
    out = b.forward(x.bfloat16(), tw, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (3, H)


def test_inputs_not_modified(weights):
    x, tw, ids = _routing(4)
    copies = (x.clone(), tw.clone(), ids.clone())
    create_backend("cpu-int8", weights).forward(x, tw, ids)
    for a, b in zip((x, tw, ids), copies, strict=True):
        assert torch.equal(a, b)


def test_dedicated_thread_pool(weights):
    x, tw, ids = _routing(4)
    inline = create_backend("cpu-fp32", weights).forward(x, tw, ids)
    pooled = create_backend("cpu-fp32", weights, num_threads=1)
    try:
        assert torch.allclose(pooled.forward(x, tw, ids), inline, rtol=1e-5, atol=1e-6)
        assert torch.allclose(pooled.submit(x, tw, ids).result(), inline, rtol=1e-5, atol=1e-6)
    finally:
        pooled.close()


def test_layers_share_one_experts_thread_and_its_team(weights):
    """Each backend built with num_threads had a worker thread of its own, and each worker its
    own OpenMP team: a model's layers then held a team per layer on the same CPUs (libgomp
    throttles its workers' spin past the CPU count, so every layer's call woke a sleeping
    team). Now every backend with the same count runs on one thread, whose team is reused."""
    import os
    import threading

    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    x, tw, ids = _routing(5, seed=3)
    ref = create_backend("cpu-int8", weights, kernel="native").forward(x, tw, ids)

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    layers = [create_backend("cpu-int8", weights, kernel="native", num_threads=3)]
    layers[0].forward(x, tw, ids)  # the thread and its team exist from here
    before = tasks()
    layers += [
        create_backend("cpu-int8", weights, kernel="native", num_threads=3) for _ in range(5)
    ]
    for layer in layers:
        assert torch.equal(layer.forward(x, tw, ids), ref)
        assert torch.equal(layer.submit(x, tw, ids).result(), ref)
    assert tasks() == before  # a thread per layer added 5 threads and 5 teams of 2 workers
    names = [t.name for t in threading.enumerate() if t.name.startswith("hetserve-cpu-experts-3")]
    assert len(names) == 1, names


def test_bad_options_are_user_errors(weights):
    from hetserve.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="group_size"):
        create_backend("cpu-int4", weights, group_size=48)
    with pytest.raises(InvalidInputError, match="num_threads"):
        create_backend("cpu-int8", weights, num_threads=0)
    with pytest.raises(InvalidInputError, match="activation"):
        create_backend("cpu-int8", weights, activation="swish2")


def test_nbytes_counts_quantized_storage(weights):
    fp32 = create_backend("cpu-fp32", weights).nbytes()
    int8 = create_backend("cpu-int8", weights).nbytes()
    int4 = create_backend("cpu-int4", weights, group_size=32).nbytes()
    assert fp32 == weights.w13.nbytes + weights.w2.nbytes
    assert fp32 / 4 < int8 < fp32 / 3.5
    assert fp32 / 8 < int4 < int8  # 4 bits + 8 bytes (scale, zero) per group of 32


# -- error bounds ----------------------------------------------------------------------------


def test_int8_weight_rounding_bound(weights):
    w = weights.w13[1]
    q, s = quantize_int8_per_channel(w)
    assert (w - q.float() * s[:, None]).abs().le(s[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_weight_rounding_bound(weights, group_size):
    w = weights.w13[1]
    q, scale, lo = quantize_int4_groupwise(w, group_size)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    w_hat = q.float().view(w.shape[0], -1, group_size) * scale[..., None] + lo[..., None]
    err = (w.view_as(w_hat) - w_hat).abs()
    assert err.le(scale[..., None] / 2 * (1 + 1e-5) + 1e-7).all()


def _lin_bound(kind, x_abs, x_step, w, group_size):
    """Promised |lin(x_hat) - x_hat @ w.T| for any input with |x| <= x_abs whose activation
    rounding step (int8 only) is at most x_step."""
    if kind == "cpu-int8":
        q, s = quantize_int8_per_channel(w)
        return s / 2 * x_abs.sum() + x_step / 2 * (q.float() * s[:, None]).abs().sum(1)
    q, scale, lo = quantize_int4_groupwise(w, group_size)
    n, k = w.shape
    w_hat = q.float().view(n, -1, group_size) * scale[..., None] + lo[..., None]
    weight_term = x_abs.view(-1, group_size).sum(1) @ scale.t() / 2
    return weight_term + x_step / 2 * w_hat.abs().view(n, k).sum(1)


def _step(kind, kernel, v_abs_max, v_range):
    # native: per row max|v| / 16383; fbgemm: one (max(v,0) - min(v,0)) / 127 per call, and a
    # call holds all tokens of an expert, so the test uses ranges over every token (an upper
    # bound); torch's int4 op keeps fp32 activations.
    if kernel == "native":
        return v_abs_max / 16383
    return v_range / 127 if kind == "cpu-int8" else 0.0


def _layer_bound(kind, kernel, weights, x, tw, ids, group_size=64):
    """Propagates the per-linear bounds through silu(gate) * up and the weighted sum."""
    x_range = x.clamp(min=0).max() - x.clamp(max=0).min()
    slots = []
    for t in range(x.shape[0]):
        for j in range(K):
            e, w = int(ids[t, j]), float(tw[t, j])
            w13 = weights.w13[e]
            step = _step(kind, kernel, x[t].abs().max(), x_range)
            d = _lin_bound(kind, x[t].abs(), step, w13, group_size)
            gate, up = (x[t] @ w13.t()).split(INTER)
            dg, du = d.split(INTER)
            h = F.silu(gate) * up
            dh = F.silu(gate).abs() * du + SILU_LIPSCHITZ * dg * (up.abs() + du)
            slots.append((t, e, w * h, abs(w) * dh))
    a_range = max(float((a.abs() + da).max()) for _, _, a, da in slots) * 2
    bound = torch.zeros(x.shape[0], H)
    for t, e, a, da in slots:
        w2 = weights.w2[e]
        step = _step(kind, kernel, (a.abs() + da).max(), a_range)
        bound[t] += da @ w2.abs().t() + _lin_bound(kind, a.abs() + da, step, w2, group_size)
    return bound


KERNEL_CASES = [
    ("cpu-int8", "native"),
    ("cpu-int8", "library"),
    ("cpu-int4", "native"),
    ("cpu-int4", "library"),
]


def _make(kind, kernel, weights):
    if kernel == "native":
        from hetserve.native import native_unavailable_reason

        reason = native_unavailable_reason()
        if reason is not None:
            pytest.skip(f"native kernel unavailable: {reason}")
    return create_backend(kind, weights, kernel=kernel)


@pytest.mark.parametrize(("kind", "kernel"), KERNEL_CASES)
@pytest.mark.parametrize("t", [1, 6])
def test_quantized_layer_within_stated_bound(weights, kind, kernel, t):
    x, tw, ids = _routing(t, seed=t)
    ref = _reference(weights, x, tw, ids)
    out = _make(kind, kernel, weights).forward(x, tw, ids)
    err = (out - ref).abs()
    bound = _layer_bound(kind, kernel, weights, x, tw, ids) + 1e-5 * ref.abs().max()
    ratio = float((err / bound).max())
    rel = float(err.max() / ref.abs().max())
    print(f"{kind}/{kernel} T={t}: max|err|/max|ref|={rel:.4f}, max err/bound={ratio:.3f}")
    assert ratio <= 1.0
    assert float(err.max()) > 0  # it is quantized at all
    # Typical size of the error (not the bound): ~1% for int8, ~15% for int4 at these shapes.
    assert rel <= {"cpu-int8": 0.05, "cpu-int4": 0.3}[kind]


@pytest.mark.parametrize(("kind", "kernel"), KERNEL_CASES)
def test_quantized_kernels_route_like_the_reference(weights, kind, kernel):
    # Same expert twice for one token, shared experts across tokens, idle experts, T = 0.
    x, _, _ = _routing(2)
    ids = torch.tensor([[2, 2, 5], [5, 7, 2]])
    tw = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    b = _make(kind, kernel, weights)
    ref = _reference(weights, x, tw, ids)
    bound = _layer_bound(kind, kernel, weights, x, tw, ids) + 1e-5 * ref.abs().max()
    assert ((b.forward(x, tw, ids) - ref).abs() <= bound).all()
    empty = b.forward(torch.zeros(0, H), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.long))
    assert empty.shape == (0, H)


def test_native_int8_is_much_closer_than_fbgemm(weights):
    x, tw, ids = _routing(8, seed=5)
    ref = _reference(weights, x, tw, ids)
    native = (_make("cpu-int8", "native", weights).forward(x, tw, ids) - ref).abs().max()
    fbgemm = (_make("cpu-int8", "library", weights).forward(x, tw, ids) - ref).abs().max()
    assert native < fbgemm


def test_native_threads_and_bad_ids(weights):
    from hetserve.errors import InvalidInputError

    x, tw, ids = _routing(7, seed=9)
    one = _make("cpu-int8", "native", weights)
    out1 = one.forward(x, tw, ids)
    two = create_backend("cpu-int8", weights, kernel="native", num_threads=2)
    try:
        for _ in range(20):  # the helper pool joins in and out; the result never changes
            assert torch.equal(two.forward(x, tw, ids), out1)
    finally:
        two.close()
    with pytest.raises(InvalidInputError, match="topk_ids outside"):
        one.forward(x, tw, torch.full_like(ids, E))


@pytest.mark.parametrize("kind", ["cpu-fp32", "cpu-int4"])
def test_native_inputs_in_any_layout_give_the_canonical_result(weights, kind):
    """The native backends pass CPU fp32 / int64 contiguous inputs straight to the kernel and
    convert anything else first: transposed views, int32 ids, bf16 or fp64 activations and
    weights must read as the same numbers (bf16 out: the fp32 result rounded)."""
    b = _make(kind, "native", weights)
    x, tw, ids = _routing(5, seed=11)
    ref = b.forward(x, tw, ids)
    assert torch.equal(b.forward(x.t().contiguous().t(), tw.t().contiguous().t(), ids), ref)
    assert torch.equal(b.forward(x, tw, ids.int()), ref)
    assert torch.equal(b.forward(x, tw.double(), ids), b.forward(x, tw.double().float(), ids))
    xb = x.bfloat16()
    assert torch.equal(b.forward(xb, tw, ids), b.forward(xb.float(), tw, ids).bfloat16())
    out = b.forward(x.double(), tw[:, :2], ids[:, :2].t().contiguous().t())
    assert out.dtype == torch.float64
    assert torch.equal(out, b.forward(x, tw[:, :2].contiguous(), ids[:, :2].contiguous()).double())


def test_native_shape_mismatches_are_user_errors(weights):
    """The kernel reads t * k weights and ids and t x hidden activations: shapes that disagree
    are refused before it runs (they would read past the tensors)."""
    from hetserve.errors import InvalidInputError

    b = _make("cpu-int8", "native", weights)
    x, tw, ids = _routing(4, seed=12)
    for args in ((x, tw[:, :2], ids), (x[:3], tw, ids), (x[:, :-1], tw, ids), (x, tw, ids[0])):
        with pytest.raises(InvalidInputError, match="shape"):
            b.forward(*args)


def test_int8_linear_bound_holds_on_fbgemm():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(4, 256, generator=g) * torch.linspace(0.1, 4, 256)
    ew = ExpertWeights(torch.cat([w, w])[None], torch.zeros(1, 256, 96))
    b = create_backend("cpu-int8", ew, kernel="library")
    y = b._linear(x, b._w13[0])[:, :96]
    q, s = quantize_int8_per_channel(w)
    bound = int8_linear_bound(x, q.float() * s[:, None], s, kernel="library")
    assert ((y - x @ w.t()).abs() <= bound * (1 + 1e-4) + 1e-5).all()


def test_int4_linear_bound_holds():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(128, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    ew = ExpertWeights(torch.cat([w, w])[None], torch.zeros(1, 256, 128))
    b = create_backend("cpu-int4", ew, group_size=128, kernel="library")
    y = b._linear(x, b._w13[0])[:, :128]
    _, scale, _ = quantize_int4_groupwise(w, 128)
    bound = int4_linear_bound(x, scale, 128)  # torch's op: fp32 activations, no act term
    assert ((y - x @ w.t()).abs() <= bound * (1 + 1e-4) + 1e-5).all()


def test_kt_without_kt_kernel_says_how_to_install(weights):
    from hetserve.moe.kt_backend import KTKernelUnavailableError, kt_kernel_import_error

    if kt_kernel_import_error() is None:
        pytest.skip("kt_kernel is installed here")
    with pytest.raises(KTKernelUnavailableError, match="pip install --no-deps kt-kernel"):
        create_backend("kt", weights)


@pytest.mark.parametrize("t", [41, 43])
@pytest.mark.parametrize("kind", ["cpu-fp32", "cpu-int8", "cpu-int4"])
def test_native_many_tokens_per_expert_and_odd_counts(kind, t):
    # 2 experts, top-2, t tokens: t pairs per expert (> the kernel's 32-pair cache block, and
    # odd, so the 2-token microkernel ends with a 1-token tail; fp32's 3-token one with a 2- or
    # 1-token tail), 3 threads on fewer cores.
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")
    g = torch.Generator().manual_seed(11)
    w = ExpertWeights(
        torch.randn(2, 64, 32, generator=g) * 0.1, torch.randn(2, 32, 32, generator=g)
    )
    x = torch.randn(t, 32, generator=g)
    ids = torch.tensor([[0, 1], [1, 0]]).repeat(22, 1)[:t]
    tw = torch.rand(t, 2, generator=g)
    ref = _reference(w, x, tw, ids)
    opts = {"group_size": 32} if kind == "cpu-int4" else {}
    out = create_backend(kind, w, kernel="native", **opts).forward(x, tw, ids)
    lib = create_backend(kind, w, kernel="library", **opts).forward(x, tw, ids)
    tol = 1e-5 if kind == "cpu-fp32" else 0.3
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    if kind == "cpu-int4":  # same quantized weights; only the int16 activation rounding differs
        assert torch.allclose(out, lib, rtol=0, atol=1e-3 * float(ref.abs().max()))
    three = create_backend(kind, w, kernel="native", num_threads=3, **opts)
    try:
        for _ in range(5):
            assert torch.equal(three.forward(x, tw, ids), out)
    finally:
        three.close()


def test_without_the_native_kernel_auto_falls_back_and_native_is_a_user_error(weights, monkeypatch):
    import hetserve.native as native
    from hetserve.errors import InvalidInputError
    from hetserve.moe.cpu_backends import CPUFp32Experts, FbgemmInt8Experts, TorchInt4Experts

    monkeypatch.setattr(native, "native_unavailable_reason", lambda: "no C compiler (test)")
    assert isinstance(create_backend("cpu-fp32", weights), CPUFp32Experts)
    assert isinstance(create_backend("cpu-int8", weights), FbgemmInt8Experts)
    assert isinstance(create_backend("cpu-int4", weights), TorchInt4Experts)
    with pytest.raises(InvalidInputError, match="native kernel unavailable here: no C compiler"):
        create_backend("cpu-int8", weights, kernel="native")
    with pytest.raises(InvalidInputError, match="kernel must be one of"):
        create_backend("cpu-int8", weights, kernel="avx512")


@pytest.mark.parametrize(
    "kind,h,inter",
    [
        ("cpu-fp32", 128, 64),
        ("cpu-fp32", 40, 24),
        ("cpu-fp32", 48, 56),
        ("cpu-int8", 128, 64),
        ("cpu-int4", 128, 64),
        ("cpu-mxfp4", 128, 64),
        ("cpu-int4", 128, 256),
    ],
)
def test_native_token_alone_equals_its_row_in_a_batch(kind, h, inter):
    # The microkernels take 1-3 tokens at a time; a token's sums must not depend on how many
    # share the call (batching, or a request joining a running batch, must not change a
    # reply). fp32 at h=40 / inter=24 and 48 / 56 also runs the rows' tails (K % 32 = 8, 16,
    # 24, after no full step of 32 or after one); 8 tokens give fp32 calls of 3, 3 and 2, and
    # int4 and MXFP4 their GEMM tiles (8 pairs per expert; int8 on AVX2 too, on AVX-512 its
    # 4-pair rows), the row kernels' bits.
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip(f"native kernel unavailable: {native_unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    w = ExpertWeights(
        torch.randn(4, 2 * inter, h, generator=g) * 0.1, torch.randn(4, h, inter, generator=g) * 0.1
    )
    t = 8
    x = torch.randn(t, h, generator=g)
    ids = torch.tensor([[0, 1]]).repeat(t, 1)  # every token on the same experts: shared calls
    tw = torch.rand(t, 2, generator=g)
    opts = {"group_size": 32} if kind == "cpu-int4" else {}
    backend = create_backend(kind, w, kernel="native", **opts)
    batch = backend.forward(x, tw, ids)
    for i in range(t):
        alone = backend.forward(x[i : i + 1], tw[i : i + 1], ids[i : i + 1])
        assert torch.equal(alone, batch[i : i + 1])
    if kind == "cpu-fp32":
        ref = _reference(w, x, tw, ids)
        assert (batch - ref).abs().max() <= 1e-5 * ref.abs().max()
