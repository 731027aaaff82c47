"""`kt`: kt-kernel's CPU MoE operator, when that package is installed.

kt-kernel pins another torch, so it goes in with `pip install --no-deps kt-kernel`. Its wheel is
built against that torch's C++ ABI; on an AVX2-only CPU it offers only the LLAMAFILE (GGUF) MoE
variant. Constructing `kt` without an importable `kt_kernel` raises a one-line error saying how to
install it; the backend itself is not wired yet (see `_KT_STATUS`).
"""

from __future__ import annotations

import importlib

from hetserve.errors import HetserveError
from hetserve.moe.experts import ExpertWeights, register_backend

KT_INSTALL_HINT = "pip install --no-deps kt-kernel"


class KTKernelUnavailableError(HetserveError):
    """kt-kernel is not installed, or does not load against this torch."""


def kt_kernel_import_error() -> str | None:
    """None when `kt_kernel` imports; otherwise the reason, in one line."""
    try:
        importlib.import_module("kt_kernel")
    except Exception as exc:  # ImportError, or an ABI mismatch surfacing as OSError/RuntimeError
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


@register_backend("kt")
def make_kt_backend(weights: ExpertWeights, activation: str = "silu", **options):
    reason = kt_kernel_import_error()
    if reason is not None:
        raise KTKernelUnavailableError(
            f"experts backend 'kt' needs kt-kernel ({reason}); install it with "
            f"`{KT_INSTALL_HINT}` (it pins another torch, hence --no-deps), or use cpu-int8"
        )
    raise KTKernelUnavailableError(
        "experts backend 'kt': kt_kernel imports, but hetserve does not wrap its MoE operator yet "
        "(on AVX2 it needs GGUF expert files); use cpu-int8"
    )
