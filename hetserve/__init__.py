"""hetserve: serve and fine-tune large MoE LLMs on heterogeneous hardware.

Public API only; everything else is reached through submodules.
"""

from hetserve.core.lora import LoRARequest
from hetserve.core.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch and the model code; keep `import hetserve` light for CLI start-up.
    if name == "LLM":
        from hetserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'hetserve' has no attribute {name!r}")
