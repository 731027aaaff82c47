"""LoRALinear against the plain formula: base(x) + scale * (x A^T) B^T on each adapter's rows,
whatever computes the base (fp32 nn.Linear, Int8Linear, a fused q/k/v Int8Linear)."""

import pytest
import torch
from torch import nn

from hetserve.engine.lora import LoRAManager, install_lora_layers
from hetserve.layers.int8_linear import Int8Linear, quantize_linears
from hetserve.layers.lora import LoRABatch, LoRALinear
from hetserve.model.lora_adapter import LoRAWeights

G = torch.Generator().manual_seed(0)


def lora(fan_in, fan_out, rank, scale):
    a = torch.randn(rank, fan_in, generator=G) * 0.1
    b = torch.randn(fan_out, rank, generator=G) * 0.1
    return LoRAWeights(a, b, scale)


def delta(x, w):
    return w.scale * (x @ w.a.T) @ w.b.T


def wrap(base, parts, batch, max_loras=3, max_rank=8):
    return LoRALinear(
        base, parts, 64, max_loras, max_rank, batch, torch.device("cpu"), torch.float32
    )


@pytest.mark.parametrize("kind", ["fp32", "int8-native", "int8-fbgemm"])
def test_each_adapter_adds_its_delta_to_its_rows(kind):
    """Two adapters: the masked path (every token against every slot in use)."""
    linear = nn.Linear(64, 96, bias=True)
    base = linear if kind == "fp32" else Int8Linear(linear, kernel=kind.split("-")[1])
    batch = LoRABatch()
    layer = wrap(base, [("proj", 96)], batch)
    w0, w2 = lora(64, 96, 4, 2.0), lora(64, 96, 8, 0.5)
    layer.set_slot(0, [w0])
    layer.set_slot(2, [w2])
    x = torch.randn(10, 64, generator=G)
    # rows 0-2: slot 2, rows 3-6: base, rows 7-9: slot 0
    batch.set([(0, 3, 2), (3, 4, None), (7, 3, 0)], span_starts=[0, 3, 7])
    y = layer(x)
    ref = base(x)
    ref[:3] += delta(x[:3], w2)
    ref[7:] += delta(x[7:], w0)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_one_adapter_and_explicit_segments_take_the_rows_path():
    batch = LoRABatch()
    linear = nn.Linear(64, 48)
    layer = wrap(linear, [("proj", 48)], batch)
    w = lora(64, 48, 8, 1.5)
    layer.set_slot(1, [w])
    x = torch.randn(9, 64, generator=G)
    batch.set([(0, 4, None), (4, 5, 1)], span_starts=[0, 4])
    ref = linear(x)
    ref[4:] += delta(x[4:], w)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    rows = torch.randn(20, 64, generator=G)  # e.g. cached rows of one sequence
    ref = linear(rows)
    ref[5:12] += delta(rows[5:12], w)
    torch.testing.assert_close(layer(rows, ((5, 12, 1),)), ref, rtol=1e-5, atol=1e-5)


def test_no_adapter_in_the_batch_costs_nothing_but_the_base(monkeypatch):
    batch = LoRABatch()
    linear = nn.Linear(64, 32)
    layer = wrap(linear, [("proj", 32)], batch)
    layer.set_slot(1, [lora(64, 32, 4, 1.0)])
    for path in ("_per_segment", "_masked"):
        monkeypatch.setattr(layer, path, lambda *a: pytest.fail("LoRA work without LoRA"))
    batch.set([(0, 5, None), (5, 2, None)], span_starts=[0])
    assert batch.segments == ()
    x = torch.randn(7, 64, generator=G)
    assert torch.equal(layer(x), linear(x))


def test_scratch_is_reused_between_forwards():
    batch = LoRABatch()
    layer = wrap(nn.Linear(64, 32), [("proj", 32)], batch)
    layer.set_slot(0, [lora(64, 32, 4, 1.0)])
    batch.set([(0, 6, 0)], span_starts=[])
    x = torch.randn(6, 64, generator=G)
    layer(x)
    first = batch.scratch(1, 1, x).data_ptr()
    layer(x)
    assert batch.scratch(1, 1, x).data_ptr() == first


def test_emptied_slot_adds_nothing():
    batch = LoRABatch()
    linear = nn.Linear(64, 32)
    layer = wrap(linear, [("proj", 32)], batch)
    layer.set_slot(0, [lora(64, 32, 4, 1.0)])
    layer.set_slot(0, None)
    batch.set([(0, 4, 0)], span_starts=[0])
    x = torch.randn(4, 64, generator=G)
    assert torch.equal(layer(x), linear(x))


class Attn(nn.Module):
    """The shape of GQAAttention's projections: q, k, v fused into one int8 matrix."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(64, 64),
            nn.Linear(64, 32),
            nn.Linear(64, 32),
        )
        self.qkv_proj = None

    def fused_projections(self):
        return {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def fused_sizes(self):
        return {"q_proj": 64, "k_proj": 32, "v_proj": 32}


def test_fused_qkv_int8_gets_each_projection_delta_on_its_slice():
    attn = Attn()
    separate = [Int8Linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    quantize_linears(attn)
    model = nn.Module()
    model.attn = attn
    targets = install_lora_layers(model, LoRABatch(), max_loras=2, max_rank=8)
    assert set(targets) == {"attn.q_proj", "attn.k_proj", "attn.v_proj"}
    layer = attn.qkv_proj
    wq, wv = lora(64, 64, 4, 2.0), lora(64, 32, 6, 1.5)  # slot 1: no adapter on k
    wk = lora(64, 32, 8, 0.5)  # slot 0: only k
    layer.set_slot(1, [wq, None, wv])
    layer.set_slot(0, [None, wk, None])
    x = torch.randn(10, 64, generator=G)
    for seqs in ([(0, 10, 1)], [(0, 3, 0), (3, 3, None), (6, 4, 1)]):  # rows path, masked path
        layer.batch.set(seqs, span_starts=[0])
        q, k, v = layer(x).split((64, 32, 32), dim=-1)
        want = [m(x) for m in separate]
        for start, n, slot in seqs:
            rows = slice(start, start + n)
            if slot == 1:
                want[0][rows] += delta(x[rows], wq)
                want[2][rows] += delta(x[rows], wv)
            elif slot == 0:
                want[1][rows] += delta(x[rows], wk)
        for got, ref in zip((q, k, v), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_batches_group_adapters_contiguously_within_max_loras():
    manager = LoRAManager.__new__(LoRAManager)
    manager.max_loras = 2
    ids = ["a", None, "b", "a", "c", None]
    groups = manager.batches(ids)
    assert sorted(i for g in groups for i in g) == list(range(len(ids)))
    for g in groups:
        assert len({ids[i] for i in g} - {None}) <= 2
        seq = [ids[i] for i in g]
        for lora_id in set(seq):  # each adapter one contiguous run
            where = [j for j, x in enumerate(seq) if x == lora_id]
            assert where == list(range(where[0], where[-1] + 1))
    assert manager.batches([None, None]) == [[0, 1]]
