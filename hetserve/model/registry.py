"""HF `architectures[0]` -> model class, imported on first use (a `hetserve.registry.Registry`)."""

from __future__ import annotations

from hetserve.errors import UnsupportedArchitectureError
from hetserve.registry import Registry

MODELS: Registry[type] = Registry(
    "architecture",
    {
        "LlamaForCausalLM": "hetserve.model.llama:LlamaForCausalLM",
        "Qwen2ForCausalLM": "hetserve.model.llama:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "hetserve.model.llama:Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "hetserve.model.qwen_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "hetserve.model.qwen_moe:Qwen3MoeForCausalLM",
        "MixtralForCausalLM": "hetserve.model.mixtral:MixtralForCausalLM",
        "DeepseekV2ForCausalLM": "hetserve.model.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "hetserve.model.deepseek:DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM": "hetserve.model.glm4_moe:Glm4MoeForCausalLM",
        "GptOssForCausalLM": "hetserve.model.gpt_oss:GptOssForCausalLM",
        "Qwen3NextForCausalLM": "hetserve.model.qwen3_next:Qwen3NextForCausalLM",
        "Qwen3_5MoeForCausalLM": "hetserve.model.qwen3_next:Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration": "hetserve.model.qwen3_next:Qwen3_5MoeForCausalLM",
        "KimiLinearForCausalLM": "hetserve.model.kimi_linear:KimiLinearForCausalLM",
        "DeepseekV32ForCausalLM": "hetserve.model.deepseek_v32:DeepseekV32ForCausalLM",
        "MiniMaxM2ForCausalLM": "hetserve.model.minimax_m2:MiniMaxM2ForCausalLM",
    },
    UnsupportedArchitectureError,
)


def supported_architectures() -> list[str]:
    return MODELS.names()


def model_class(architecture: str) -> type:
    return MODELS.get(architecture)
