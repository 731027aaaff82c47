"""Start-up does no arithmetic on the meta model: torch runs it through Python reference ops
whose first use imports torch._dynamo, 1.5-6 s of every load on the 2-core VM."""

import subprocess
import sys

_CHILD = """
import sys
from hetserve import LLM
LLM(model=sys.argv[1], device="cpu", max_model_len=128, num_kv_blocks=16)
print("dynamo" if "torch._dynamo" in sys.modules else "clean")
"""


def test_loading_a_model_never_imports_torch_dynamo(tiny_model):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny_model("qwen3-moe"))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean"
