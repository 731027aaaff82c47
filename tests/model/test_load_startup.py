"""Start-up does no arithmetic on the meta model: torch runs it through Python reference ops
whose first use imports torch._dynamo, 1.5-6 s of every load on the 2-core VM; nor an
empty_like of a meta tensor (Module.to_empty), whose reference op imports torch.fx's symbolic
shapes and sympy, 0.7 s."""

import subprocess
import sys

_CHILD = """
import sys
from hetserve import LLM
LLM(model=sys.argv[1], device="cpu", max_model_len=128, num_kv_blocks=16)
slow = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy")
print(" ".join(m for m in slow if m in sys.modules) or "clean")
"""


def test_loading_a_model_never_imports_torch_dynamo_or_sympy(tiny_model):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny_model("qwen3-moe"))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean"
