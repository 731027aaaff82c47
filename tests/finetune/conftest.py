import json

import pytest

ALPACA = [
    {"instruction": "say hello", "input": "", "output": "hello world"},
    {"instruction": "count", "input": "one two", "output": "three four five"},
    {"instruction": "name the tiers", "input": "", "output": "memory disk pool"},
    {"instruction": "who runs attention", "input": "", "output": "the accelerator"},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "and experts?"},
            {"from": "gpt", "value": "they run on the cpu"},
        ],
        "system": "be brief",
    }
]


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "alpaca.json").write_text(json.dumps(ALPACA))
    (d / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in SHAREGPT))
    info = {
        "tiny_alpaca": {"file_name": "alpaca.json"},
        "tiny_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt"},
    }
    (d / "dataset_info.json").write_text(json.dumps(info))
    return d


@pytest.fixture
def base_config(tiny_model, data_dir, tmp_path):
    def make(family="qwen3-moe", **kw):
        cfg = {
            "model_name_or_path": str(tiny_model(family)),
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "lora",
            "lora_target": "all",
            "lora_rank": 8,
            "dataset": "tiny_alpaca",
            "dataset_dir": str(data_dir),
            "cutoff_len": 64,
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 2,
            "learning_rate": 1e-2,
            "max_steps": 4,
            "logging_steps": 1,
            "save_steps": 100,
            "seed": 1,
        }
        cfg.update(kw)
        return cfg

    return make
