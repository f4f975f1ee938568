"""Page kernels and their routing: one implementation per kernel, chosen once from the device.

`select_tier` picks the kernel set at start-up from the device's compute capability (logged, and
overridable with EngineConfig.kernels / KVMEM_KERNELS): Triton on CUDA devices of capability 8.0 and
newer, CuPy RawKernels on older CUDA devices, torch everywhere else. Every kernel keeps a torch
reference that the tests compare it with; on the CPU, Triton kernels run under TRITON_INTERPRET=1.

The kernels live by subsystem: attention/ (decode and prefill attention over the pool), layer/ (a decoder layer's
and a step's compute), pages/ (K/V writes, restores, page summaries). pdl.py (programmatic dependent launch)
stays here beside the tier that decides it (`select_tier`): the decode step's chained kernels of all three use it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("triton", "cupy", "torch")


class KernelUnavailableError(RuntimeError):
    """The requested kernel set cannot run on this device (missing package or capability)."""


@dataclass(frozen=True)
class KernelTier:
    """The kernel set of one device: which backend runs the page kernels, and what the card offers."""

    backend: str  # triton, cupy or torch
    device: str  # e.g. "cuda:0 NVIDIA H200 (sm_90)" or "cpu"
    capability: tuple[int, int] | None  # CUDA compute capability; None on the CPU
    native_fp8: bool  # fp8 e4m3 conversions in hardware (sm_89 and newer)
    pdl: bool = False  # Triton kernels launch with programmatic dependent launch (kernels/pdl.py: sm_90 and newer)

    @property
    def interpreted(self) -> bool:
        """Triton on the CPU: the interpreter (tests only; slow)."""
        return self.backend == "triton" and self.capability is None


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def select_tier(device: torch.device, requested: str = "auto") -> KernelTier:
    """The kernel set for `device`; `requested` forces one (KernelUnavailableError when it cannot run)."""
    if requested not in ("auto", *BACKENDS):
        raise KernelUnavailableError(f"kernel set {requested!r} not in auto, {', '.join(BACKENDS)}")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        name = f"{device} {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
        native_fp8 = cap >= (8, 9)
        if requested == "auto":
            if cap >= (8, 0) and _available("triton"):
                backend = "triton"
            elif _available("cupy"):
                backend = "cupy"
            else:
                backend = "torch"
        else:
            backend = requested
    else:
        cap, name, native_fp8 = None, str(device), False
        backend = "torch" if requested == "auto" else requested
        if backend == "cupy":
            raise KernelUnavailableError("cupy kernels need a CUDA device")
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelUnavailableError("triton kernels on the CPU need TRITON_INTERPRET=1 (tests only)")
    if backend in ("triton", "cupy") and not _available(backend):
        raise KernelUnavailableError(f"kernel set {backend!r} requested but the package is not installed")
    pdl_on = False
    if backend == "triton" and device.type == "cuda":
        pdl_on = importlib.import_module(f"{__name__}.pdl").enabled(device)
    tier = KernelTier(backend, name, cap, native_fp8, pdl_on)
    logger.info("page kernels: %s on %s (requested %s), programmatic dependent launch %s", backend, name, requested,
                "on" if pdl_on else "off")  # fmt: skip
    return tier


_CPU_TIER = KernelTier("torch", "cpu", None, False)
_active: KernelTier = _CPU_TIER


def use_tier(tier: KernelTier) -> None:
    """Make `tier` the process's kernel set (the builder calls this once at start-up; tests may too)."""
    global _active
    _active = tier


def active_tier() -> KernelTier:
    """The process's kernel set: torch until the engine chose one at start-up."""
    return _active


def triton_module(name: str, device: torch.device) -> ModuleType | None:
    """services.engine.kernels.<name> (e.g. "layer.norm_triton") when the process's tier is Triton on `device`'s
    kind (compiled on CUDA, interpreted on the CPU in tests), else None: the caller runs its torch code."""
    tier = _active
    if tier.backend != "triton" or (device.type == "cuda") == tier.interpreted:
        return None
    return importlib.import_module(f"services.engine.kernels.{name}")
