"""What cannot be served is refused with one line naming the problem and the fix: in Python
(ModelLoadError / InvalidInputError), on the command line (exit 2, no traceback)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetserve import LLM
from hetserve.cli import main
from hetserve.errors import ModelLoadError
from hetserve.model.lora_adapter import read_adapter
from tests.lora_util import write_random_adapter


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("qwen3-moe")


def edit_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_weights(adapter, fn):
    path = adapter / "adapter_model.safetensors"
    save_file(fn(load_file(str(path))), str(path))


def rename_first(state, new_name):
    key = next(iter(state))
    state[new_name] = state.pop(key)
    return state


CASES = {
    "not a dir": (lambda a: a / "nope", "is not a directory"),
    "no config": (
        lambda a: (a / "adapter_config.json").unlink() or a,
        "has no adapter_config.json",
    ),
    "bad json": (
        lambda a: (a / "adapter_config.json").write_text("{") and a,
        "adapter_config.json is not valid JSON",
    ),
    "not lora": (lambda a: edit_config(a, peft_type="IA3") or a, "is a IA3 adapter"),
    "dora": (lambda a: edit_config(a, use_dora=True) or a, "DoRA .*`hetserve export"),
    "experts (params)": (
        lambda a: edit_config(a, target_parameters=["gate_up_proj"]) or a,
        "on routed experts",
    ),
    "experts (modules)": (
        lambda a: (
            edit_weights(
                a,
                lambda s: rename_first(
                    s, "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
                ),
            )
            or a
        ),
        r"LoRA on routed experts \(model.layers.0.mlp.experts.3.gate_proj\)",
    ),
    "modules_to_save": (
        lambda a: edit_config(a, modules_to_save=["lm_head"]) or a,
        "sets modules_to_save",
    ),
    "no weights": (
        lambda a: (a / "adapter_model.safetensors").unlink() or a,
        "has no adapter_model.safetensors",
    ),
    "rank mismatch": (lambda a: edit_config(a, r=8) or a, "not rank 8 as adapter_config.json says"),
    "stray tensor": (
        lambda a: (
            edit_weights(a, lambda s: {**s, "base_model.model.lm_head.weight": torch.zeros(2)}) or a
        ),
        "holds 'base_model.model.lm_head.weight', which is not a LoRA weight",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unservable_adapters_are_refused_with_one_line(base, tmp_path, case):
    make, message = CASES[case]
    adapter = make(write_random_adapter(base, tmp_path / "a"))
    with pytest.raises(ModelLoadError, match=message) as info:
        read_adapter(adapter)
    assert "\n" not in str(info.value)


def test_dora_is_readable_for_merging(base, tmp_path):
    adapter = write_random_adapter(base, tmp_path / "a", use_dora=True)
    assert read_adapter(adapter, allow_dora=True).use_dora


def test_model_checks_unknown_module_shape_and_rank(base, tmp_path):
    unknown = write_random_adapter(base, tmp_path / "u")
    edit_weights(unknown, lambda s: {k.replace("q_proj", "gate_proj"): v for k, v in s.items()})
    with pytest.raises(ModelLoadError, match=r"targets model.layers.0.self_attn.gate_proj, which"):
        LLM(base, lora_modules={"u": str(unknown)})
    shape = write_random_adapter(base, tmp_path / "s")
    edit_weights(
        shape,
        lambda s: {k: v[:, :32].contiguous() if "q_proj.lora_A" in k else v for k, v in s.items()},
    )
    with pytest.raises(ModelLoadError, match="maps 32 -> 64 features but the model's maps 64"):
        LLM(base, lora_modules={"s": str(shape)})
    big = write_random_adapter(base, tmp_path / "b", rank=32)
    with pytest.raises(
        ModelLoadError, match=r"rank 32, above max_lora_rank 16.*--max-lora-rank 32"
    ):
        LLM(base, lora_modules={"b": str(big)})
    assert LLM(base, lora_modules={"b": str(big)}, max_lora_rank=32).engine.lora.adapters()


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--lora-modules", "a=/no/such/dir"],
            "error: LoRA adapter '/no/such/dir' is not a directory",
        ),
        (["--lora-modules", "justaname"], "error: --lora-modules takes NAME=DIR pairs"),
        (["--max-loras", "0"], "error: --max-loras must be >= 1, got 0"),
    ],
)
def test_cli_mistakes_exit_2_with_one_line(base, capsys, argv, message):
    rc = main(["generate", "hi", "--model", str(base), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(message), err


def test_dora_on_the_command_line_points_to_export(base, tmp_path, capsys):
    adapter = write_random_adapter(base, tmp_path / "d", use_dora=True)
    rc = main(["generate", "hi", "--model", str(base), "--lora-modules", f"d={adapter}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "hetserve export" in err[0]
