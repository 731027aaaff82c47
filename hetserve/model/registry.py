"""HF `architectures[0]` -> model class. Classes are imported on demand."""

from __future__ import annotations

import importlib

from hetserve.errors import UnsupportedArchitectureError

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "hetserve.model.llama",
    "Qwen2ForCausalLM": "hetserve.model.llama",
    "Qwen3ForCausalLM": "hetserve.model.llama",
    "Qwen2MoeForCausalLM": "hetserve.model.qwen_moe",
    "Qwen3MoeForCausalLM": "hetserve.model.qwen_moe",
    "MixtralForCausalLM": "hetserve.model.mixtral",
    "DeepseekV2ForCausalLM": "hetserve.model.deepseek",
    "DeepseekV3ForCausalLM": "hetserve.model.deepseek",
    "Glm4MoeForCausalLM": "hetserve.model.glm4_moe",
    "GptOssForCausalLM": "hetserve.model.gpt_oss",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str):
    module = _ARCHITECTURES.get(architecture)
    if module is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return getattr(importlib.import_module(module), architecture)
