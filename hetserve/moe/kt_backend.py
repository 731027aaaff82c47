"""`kt`: kt-kernel's CPU MoE operator, when that package is installed.

kt-kernel pins another torch, so it goes in with `pip install --no-deps kt-kernel` (plus its
`gguf` dependency). Checked here (kt-kernel 0.7.2, 2-core AVX2 box): it installs and imports
beside torch 2.13, but its AVX2 build has no MOE_INT8/INT4 operator ("not compiled with int8
support"); on AVX2 it offers only LLAMAFILE, which reads GGUF expert files. AMX/AVX-512 builds
have `KTMoEWrapper(method="AMXINT8")` with `load_weights_from_tensors`. Wrapping either is left
for a machine that has them; until then constructing `kt` raises a one-line error saying why
and how to install, never a silent fallback.
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
