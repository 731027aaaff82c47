"""Placement rules: matching, defaults, typed errors naming the rule, the table."""

from __future__ import annotations

import pytest

from hetserve.moe.placement import PlacementError, load_rules, parse_rules, place

MODULES = [
    "model.embed_tokens",
    *[f"model.layers.{i}.self_attn" for i in range(4)],
    "model.layers.0.mlp",  # dense first layer (DeepSeek style)
    *[f"model.layers.{i}.mlp.experts" for i in range(1, 4)],
    *[f"model.layers.{i}.mlp.shared_experts" for i in range(1, 4)],
    "model.norm",
    "lm_head",
]
BYTES = {name: 1000 for name in MODULES} | {
    f"model.layers.{i}.mlp.experts": 10**6 for i in (1, 2, 3)
}


def test_defaults_put_routed_experts_on_cpu_int8_and_the_rest_on_the_accelerator():
    p = place(MODULES, cuda_device_count=1)
    a = p.get("model.layers.2.mlp.experts")
    assert (a.device, a.backend, a.rule) == ("cpu", "cpu-int8", "routed-experts")
    assert p.get("model.layers.2.mlp.shared_experts").device == "cuda"
    assert p.get("lm_head", "prefill").device == "cuda"
    assert place(MODULES, cuda_device_count=0).get("lm_head").device == "cpu"
    # An engine on the CPU of a machine with a GPU (training with experts on the CPU, found on
    # an H200): `auto` is the engine's device, not the GPU.
    assert place(MODULES, cuda_device_count=1, auto_device="cpu").get("lm_head").device == "cpu"


def test_mixtral_names_and_dense_models_under_defaults():
    p = place(["model.layers.0.block_sparse_moe.experts", "lm_head"], cuda_device_count=0)
    assert p.get("model.layers.0.block_sparse_moe.experts").backend == "cpu-int8"
    place(["model.layers.0.mlp", "lm_head"], cuda_device_count=0)  # no experts: still fine


def test_yaml_rules_with_layer_range_and_phases(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        r"""
rules:
  - name: early-experts-gpu
    match: 'model\.layers\.(\d+)\.mlp\.experts'
    layers: [1, 1]
    device: cuda:0
    backend: torch
  - name: experts-prefill-gpu
    match: 'model\.layers\.(\d+)\.mlp\.experts'
    phase: prefill
    device: cuda
    backend: torch
  - name: experts-decode-cpu
    match: 'model\.layers\.(\d+)\.mlp\.experts'
    phase: decode
    device: cpu
    backend: cpu-int4
  - name: rest
    match: '.*'
    device: auto
"""
    )
    p = place(MODULES, load_rules(path), cuda_device_count=1)
    assert p.get("model.layers.1.mlp.experts", "decode").device == "cuda:0"
    assert p.get("model.layers.3.mlp.experts", "prefill").backend == "torch"
    d = p.get("model.layers.3.mlp.experts", "decode")
    assert (d.device, d.backend, d.rule) == ("cpu", "cpu-int4", "experts-decode-cpu")
    per_device = p.bytes_per_device(BYTES)
    # layers 2 and 3 are resident on both devices (one per phase); layer 1 only on cuda:0.
    assert per_device["cpu"] == 2 * 10**6
    assert per_device["cuda"] == 2 * 10**6 + 1000 * (len(MODULES) - 3)
    table = p.table(BYTES)
    assert "experts-decode-cpu" in table and "total cpu" in table and "1.91 MiB" in table


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"name": "r", "match": "x", "backend": "cpu-int9"}, "rule 'r': unknown experts backend"),
        ({"name": "r", "match": "x", "device": "gpu"}, "rule 'r': unknown device 'gpu'"),
        ({"name": "r", "match": "x", "phase": "train"}, "rule 'r': phase 'train'"),
        ({"name": "r", "match": "(x"}, "rule 'r': bad regex"),
        ({"name": "r", "match": "x", "layers": [1, 2]}, r"rule 'r': 'layers' needs a \(\\d\+\)"),
        ({"name": "r", "match": "x", "device": "cuda", "backend": "cpu-int8"}, "runs on cpu"),
        ({"name": "r", "match": "x", "colour": "red"}, "unknown keys"),
    ],
)
def test_invalid_rules_name_the_rule(rule, message):
    with pytest.raises(PlacementError, match=message):
        parse_rules({"rules": [rule]})


def test_rule_matching_nothing_is_an_error():
    rules = parse_rules(
        [{"name": "typo", "match": r"model\.layer\.(\d+)\.mlp\.experts"}, {"match": ".*"}]
    )
    with pytest.raises(PlacementError, match="rule 'typo'.*matches no module"):
        place(MODULES, rules, cuda_device_count=0)


def test_module_left_unplaced_is_an_error():
    rules = parse_rules([{"name": "experts", "match": r".*\.experts", "device": "cpu"}])
    with pytest.raises(PlacementError, match="module 'model.embed_tokens' is left unplaced"):
        place(MODULES, rules, cuda_device_count=0)


def test_phase_only_rule_leaves_the_other_phase_unplaced():
    rules = parse_rules([{"name": "p", "match": ".*", "phase": "prefill"}])
    with pytest.raises(PlacementError, match="unplaced for phase 'decode'"):
        place(["lm_head"], rules, cuda_device_count=0)


def test_missing_cuda_device_names_the_rule():
    rules = parse_rules([{"name": "gpu1", "match": ".*", "device": "cuda:1"}])
    with pytest.raises(PlacementError, match="rule 'gpu1': device 'cuda:1' does not exist"):
        place(["lm_head"], rules, cuda_device_count=1)
    with pytest.raises(PlacementError, match="rule 'gpu1'"):
        place(["lm_head"], rules, cuda_device_count=0)


def test_bad_files_are_typed_errors(tmp_path):
    with pytest.raises(PlacementError, match="cannot read"):
        load_rules(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [")
    with pytest.raises(PlacementError, match="not valid YAML"):
        load_rules(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("rules: []\n")
    with pytest.raises(PlacementError, match="non-empty list"):
        load_rules(empty)


def test_duplicate_rule_names_are_an_error():
    rules = parse_rules([{"name": "a", "match": "x"}, {"name": "a", "match": ".*"}])
    with pytest.raises(PlacementError, match="'a' is used by more than one rule"):
        place(["x"], rules, cuda_device_count=0)
