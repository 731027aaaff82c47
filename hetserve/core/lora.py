"""LoRARequest: which LoRA adapter a generation runs with (vLLM's noun, same fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter; `lora_path` (a PEFT adapter directory) loads it under that
    name on first use. `lora_int_id` is accepted for vLLM compatibility: hetserve identifies an
    adapter by its content (a hash of its weights and scaling), not by this number."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
