"""User mistakes in configs, datasets and templates: one line on stderr and exit code 2."""

import json

import pytest
import yaml

from hetserve.cli import main


def run_cli(tmp_path, cfg, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["finetune", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def one_line_error(tmp_path, cfg, capsys, *needles):
    rc, err = run_cli(tmp_path, cfg, capsys)
    errors = [line for line in err if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1, err
    assert "Traceback" not in "\n".join(err)
    for n in needles:
        assert n in errors[0], errors[0]


def test_unknown_key_names_the_closest(base_config, tmp_path, capsys):
    cfg = base_config(lora_rnak=8)
    one_line_error(tmp_path, cfg, capsys, "'lora_rnak'", "'lora_rank'")


def test_ignored_keys_print_one_line_each(base_config, tmp_path, capsys):
    cfg = base_config(report_to="none", ddp_timeout=9, dataset="nope")
    rc, err = run_cli(tmp_path, cfg, capsys)
    assert rc == 2
    assert sum("ignoring 'report_to'" in line for line in err) == 1
    assert sum("ignoring 'ddp_timeout'" in line for line in err) == 1


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"learning_rate": "fast"}, ["learning_rate", "'fast'"]),
        ({"lr_scheduler_type": "cosine_restarts"}, ["lr_scheduler_type"]),
        ({"quantization_bit": 3}, ["quantization_bit"]),
        ({"quantization_bit": 8}, ["use_kt"]),
        ({"kt_optimize_rule": "rules.yaml"}, ["kt_optimize_rule", "use_kt"]),  # was ignored
        ({"stage": "dpo"}, ["'dpo'"]),
        ({"dataset": "tiny_alpacca"}, ["tiny_alpacca", "did you mean 'tiny_alpaca'"]),
        ({"template": "qwen4"}, ["qwen4", "did you mean"]),
        ({"lora_target": "q_proj,gate_up"}, ["'gate_up'"]),
        ({"resume_from_checkpoint": "/nonexistent"}, ["resume_from_checkpoint"]),
    ],
)
def test_config_mistakes(base_config, tmp_path, capsys, change, needles):
    one_line_error(tmp_path, base_config(**change), capsys, *needles)


def test_peft_moe_names_refused_for_deepseek(base_config, tmp_path, capsys):
    cfg = base_config("deepseek-v3", lora_target="q_a_proj,gate_proj")
    one_line_error(tmp_path, cfg, capsys, "'gate_proj'", "routed experts")


@pytest.mark.parametrize(
    "rows, needles",
    [
        ([{"instruction": "a", "output": "b"}, {"instruction": "c"}], ["row 2", "'output'"]),
        ([{"instruction": "a", "output": 3}], ["row 1", "string"]),
        ([{"instruction": "a", "output": "b", "history": ["x"]}], ["row 1", "history"]),
    ],
)
def test_bad_alpaca_rows_name_file_and_row(base_config, data_dir, tmp_path, capsys, rows, needles):
    (data_dir / "alpaca.json").write_text(json.dumps(rows))
    one_line_error(tmp_path, base_config(), capsys, "alpaca.json", *needles)


def test_bad_sharegpt_row_names_file_and_row(base_config, data_dir, tmp_path, capsys):
    good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    bad = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}
    (data_dir / "chat.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    one_line_error(tmp_path, base_config(dataset="tiny_chat"), capsys, "chat.jsonl", "row 2")


def test_template_that_is_not_prefix_stable(base_config, tiny_model, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3-moe"), model)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    # A template that numbers turns from the end: every rendering of a longer conversation
    # changes the text of the earlier turns.
    tc["chat_template"] = (
        "{% for m in messages %}{{ messages|length - loop.index }}{{ m['content'] }}{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    one_line_error(tmp_path, base_config(model_name_or_path=str(model)), capsys, "prefix")


@pytest.mark.parametrize(
    "key,value",
    [
        ("model_name_or_path", 5), ("dataset", [1, 2]), ("template", ["a"]), ("lora_target", 3),
        # Found in a trial: each was a traceback (`key:` left empty reached a comparison with
        # None; int(inf) an OverflowError; an infinite num_train_epochs one in the schedule).
        ("lora_rank", None), ("cutoff_len", None), ("output_dir", None),
        ("model_name_or_path", None), ("lora_target", None), ("lora_rank", float("inf")),
        ("save_steps", "1e999"), ("num_train_epochs", float("inf")),
        ("learning_rate", float("nan")),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_one_line(base_config, tmp_path, capsys, key, value):
    one_line_error(tmp_path, base_config(**{key: value}), capsys, f"{key}:", "not a valid")


def test_a_list_of_datasets_is_the_comma_separated_names(base_config):
    from hetserve.finetune.config import parse_config

    cfg, _ = parse_config(base_config(dataset=["a", "b"], eval_dataset=["c"]))
    assert cfg.datasets() == ["a", "b"] and cfg.datasets("eval_dataset") == ["c"]


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("per_device_eval_batch_size", 0, "per_device_eval_batch_size must be >= 1"),
        ("adam_beta1", 2.0, "adam_beta1 and adam_beta2 must be in [0, 1)"),
        ("eval_strategy", "bogus", "eval_strategy 'bogus'"),
        ("eval_steps", 0, "eval_steps must be >= 1"),
        ("warmup_steps", -1, "warmup_steps must be >= 0"),
        ("lora_alpha", 0, "lora_alpha must be > 0"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ],
)
def test_a_value_out_of_range_is_one_line_before_training(
    base_config, tmp_path, capsys, key, value, needle
):
    """Each was a traceback mid-run (a zero eval batch, Adam's betas) or silently taken."""
    one_line_error(tmp_path, base_config(**{key: value}), capsys, needle)


def test_a_val_size_count_above_the_rows_is_one_line(base_config, tmp_path, capsys):
    """It was cut to the rows less one: training ran on a single example, silently."""
    one_line_error(tmp_path, base_config(val_size=1000), capsys, "val_size 1000 leaves no rows")


def test_ctrl_c_says_which_checkpoint_to_go_on_from(base_config, tmp_path, capsys, monkeypatch):
    """It exited 130 without a word: whether anything was kept, and how to resume, unsaid."""
    from hetserve.finetune import trainer

    steps = trainer._Loop.steps

    def interrupted(self, done):
        for step in steps(self, done):
            yield step
            if step == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(trainer._Loop, "steps", interrupted)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(base_config(save_steps=1)))
    assert main(["finetune", str(path)]) == 130
    printed = capsys.readouterr()
    said = printed.out + printed.err
    assert "the latest checkpoint is" in said and "checkpoint-2" in said
    assert "resume_from_checkpoint: true" in said
