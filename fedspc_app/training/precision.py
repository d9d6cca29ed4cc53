"""Which device a run trains on (``device = auto | cpu | cuda``) and which arithmetic
(``precision = auto | fp32 | bf16``).

``bf16`` runs the forward pass and the loss under bfloat16 autocast (parameters,
gradients and the optimizer stay float32). It pays only where the device computes
bfloat16 natively: CUDA devices that support it, and CPUs with AMX or AVX-512 bf16
units, where it is 1.6-2.8x faster per step than fp32 (README, Speed). Elsewhere
autocast is emulated and slower than fp32, so ``auto`` picks bf16 only where it is
native and fp32 everywhere else.
"""

from __future__ import annotations

import functools
import os

import torch

from fedspc_app.core.config import PRECISIONS, RunConfig
from fedspc_app.core.errors import ConfigError


def _cpu_native_bf16() -> bool:
    # torch's own CPU feature probes (cpuinfo); absent in builds without them.
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 in hardware (not emulated)."""
    return _native_bf16(torch.device(device).type)


@functools.cache
def _native_bf16(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(
            including_emulation=False)
    if device_type == "cpu":
        return _cpu_native_bf16()
    return False


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``fp32`` or ``bf16``: ``auto`` becomes bf16 where ``device`` has it natively."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return precision


def strict_fp32() -> None:
    """No TensorFloat-32 in this process: float32 matrix products and convolutions on
    CUDA keep their 23-bit mantissa (PyTorch lets cuDNN use TF32 by default)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def precision_report(precision: str, device: torch.device | str) -> dict[str, object]:
    """What a run records of its precision: the setting, what it resolves to on
    ``device``, whether that device computes bfloat16 natively and, on CUDA, that
    float32 work does not use TF32."""
    device = torch.device(device)
    report = {"setting": precision, "resolved": resolve_precision(precision, device),
              "device": device.type, "native-bf16": native_bf16(device)}
    if device.type == "cuda":
        report["tf32"] = False
    return report


def emulation_warning(precision: str, device: torch.device | str) -> str | None:
    """A warning for ``bf16`` asked for on a device that only emulates it."""
    if precision != "bf16" or native_bf16(device):
        return None
    return (f"precision = 'bf16' on a {torch.device(device).type} device without native "
            "bfloat16 (no AMX or AVX-512 bf16 on a CPU, or a GPU without bf16): autocast "
            "is emulated there and slower than fp32; 'auto' would pick fp32. Going on "
            "in bf16 as asked")


# cuBLAS needs a fixed workspace for deterministic results (CUDA >= 10.2).
CUBLAS_WORKSPACE = ":4096:8"


def apply_determinism(deterministic: bool) -> dict[str, object]:
    """``deterministic = true``: PyTorch's deterministic algorithms, cuDNN's
    deterministic (non-benchmarking) mode and a fixed cuBLAS workspace, for this
    process; what it set, as config.json records it.

    An operation without a deterministic implementation warns (PyTorch's
    ``warn_only``) instead of stopping a run in the middle. On CPUs the project's
    runs already repeat bit for bit and nothing changes; on GPUs it costs speed
    (cuDNN stops picking the fastest kernels, some operations take slower paths).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {"setting": deterministic,
            "algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn-deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn-benchmark": bool(torch.backends.cudnn.benchmark)}


def resolve_device(config: RunConfig) -> torch.device:
    """``device = auto`` picks CUDA when available."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run-config 'device' = 'cuda' but CUDA is not available here")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)
