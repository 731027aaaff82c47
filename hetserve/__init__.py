"""hetserve: serve and fine-tune large MoE LLMs on heterogeneous hardware.

Public API only; everything else is reached through submodules.
"""

from hetserve.core.beam_search import BeamSearchParams
from hetserve.core.lora import LoRARequest
from hetserve.core.request import NewRequest
from hetserve.core.sampling import SamplingParams

__all__ = [
    "LLM", "AsyncLLM", "BeamSearchParams", "EngineConfig", "LoRARequest", "NewRequest",
    "SamplingParams",
]  # fmt: skip
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch and the model code; keep `import hetserve` light for CLI start-up.
    if name == "LLM":
        from hetserve.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from hetserve.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name == "EngineConfig":
        from hetserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'hetserve' has no attribute {name!r}")
