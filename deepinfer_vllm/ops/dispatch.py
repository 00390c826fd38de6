"""Which implementation runs each operator: chosen once, when the layer that owns it is built.

An operator with device kernels is a ``KernelOp`` (the shape of vLLM's ``CustomOp``):
``forward_native`` is the PyTorch reference (runs everywhere, and every kernel is tested
against it), ``forward_triton`` the Triton kernels (CUDA), ``forward_npu`` ``torch_npu``'s
fused operators. The constructor takes the device and dtype the layer computes in, asks
``choose`` once, binds the chosen method and logs the choice once per (family, backend,
device); a call then runs the bound method, with no environment read or device query.

Three families, each with its setting (``envs``): ``attention`` (cache stores, indexer and
sparse attention; ``DEEPINFER_ATTENTION_KERNELS``), ``gemm`` (weight GEMMs of the resident
formats; ``DEEPINFER_GEMM_KERNELS``) and ``fused`` (the per-token chains: mHC sites, RMSNorm,
RoPE; ``DEEPINFER_FUSED_KERNELS``). ``auto`` picks:

- ``attention``: Triton on a CUDA device with Triton installed, else the reference;
- ``gemm``: Triton for bf16 models on CUDA, else the reference (fp32 models keep its fp64
  accumulation; batch-invariant mode keeps its fixed row tiles, the kernels tile by rows);
- ``fused``: ``torch_npu`` for bf16 models on an NPU, Triton for bf16 models on CUDA, else the
  reference (fp32 models keep the reference's summation order).

A platform plugs in its own implementation of an operator by registering a subclass under
the operator's name (``KernelOp.register_oot``, as vLLM's ``CustomOp.register_oot``): every
later construction of that operator builds the subclass. DeepSeek's kernel libraries
(``flash_mla``, ``deep_gemm``, ``deep_select``) are detected and reported; their V4.1 entry
points target SM100 and are not wired (no device to test them on).

This module imports no vLLM (``ops`` stays importable on a bare GPU host).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from deepinfer_vllm import envs

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "FAMILIES", "KernelOp", "choose", "chosen", "vendor_libraries"]

FAMILIES = ("attention", "gemm", "fused")
BACKENDS = ("torch", "triton", "npu")
VENDOR_LIBRARIES = ("flash_mla", "deep_gemm", "deep_select")

_SETTINGS = {
    "attention": ("DEEPINFER_ATTENTION_KERNELS", envs.attention_kernels),
    "gemm": ("DEEPINFER_GEMM_KERNELS", envs.gemm_kernels),
    "fused": ("DEEPINFER_FUSED_KERNELS", envs.fused_kernels),
}

# How the log line names a family.
_LABELS = {"gemm": "GEMM"}

_logged: set[tuple[str, str, str]] = set()


def vendor_libraries() -> list[str]:
    """Names of DeepSeek's kernel libraries importable in this environment."""
    return [name for name in VENDOR_LIBRARIES if importlib.util.find_spec(name) is not None]


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _torch_npu_importable() -> bool:
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None
    return importlib.util.find_spec("torch_npu") is not None


def _forced_triton(variable: str, device: torch.device) -> str:
    """Check that ``variable=triton`` can run on ``device``; the reason to log."""
    if not _triton_available():
        raise RuntimeError(f"{variable}=triton but Triton is not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{variable}=triton needs a CUDA device (got {device}); "
            "on a CPU set TRITON_INTERPRET=1 (tests only)"
        )
    return f"{variable}=triton"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _auto(family: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    if family == "fused" and device.type == "npu" and dtype == torch.bfloat16:
        return "npu", "NPU device, bf16"
    if family == "gemm" and envs.batch_invariant():
        # The kernels pick tiles and K splits by M; the reference's fixed row tiles do not.
        return "torch", "DEEPINFER_BATCH_INVARIANT=1"
    if family == "attention":
        if device.type == "cuda" and _triton_available():
            return "triton", f"CUDA device {torch.cuda.get_device_name(device)}"
        return "torch", f"{device.type} device"
    if device.type == "cuda" and _triton_available() and dtype == torch.bfloat16:
        return "triton", f"CUDA device {torch.cuda.get_device_name(device)}, bf16"
    return "torch", f"{device.type} device, {_dtype_name(dtype)}"


def _decide(family: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    if device.type == "meta":
        # A model built on the meta device (memory planning) never runs: no setting applies.
        return "torch", "meta device"
    variable, read = _SETTINGS[family]
    mode = read()
    if mode == "torch":
        return "torch", f"{variable}=torch"
    if mode == "triton":
        why = _forced_triton(variable, device)
        if family == "gemm" and dtype != torch.bfloat16:
            raise RuntimeError(
                f"{variable}=triton needs a bfloat16 model (got {dtype}); "
                "fp32 models run the fp64-accumulating reference GEMMs"
            )
        return "triton", why
    if mode == "npu":
        if not _torch_npu_importable():
            raise RuntimeError(f"{variable}=npu needs torch_npu (pip install 'deepinfer-vllm[ascend]')")
        return "npu", f"{variable}=npu"
    return _auto(family, device, dtype)


def _notes(family: str, backend: str, device: torch.device) -> str:
    if family != "attention" or backend != "triton" or device.type != "cuda":
        return ""
    notes = ""
    from deepinfer_vllm.ops.triton.sparse_mla_decode_gluon import GLUON_AVAILABLE

    if GLUON_AVAILABLE and torch.cuda.get_device_capability(device) == (9, 0):
        notes += "; sparse MLA decode: warp-specialised Gluon kernel (sm90)"
    vendors = vendor_libraries()
    if vendors:
        notes += f"; found {', '.join(vendors)} (their V4.1 paths target SM100 and are not wired; using ours)"
    return notes


def choose(family: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend (``"torch"``, ``"triton"`` or ``"npu"``) that runs ``family``'s operators
    for a layer computing in ``dtype`` on ``device``; logged once per (family, backend,
    device). Called when a layer is built, never per call."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    if isinstance(device, str):
        device = torch.device(device)
    backend, why = _decide(family, device, dtype)
    key = (family, backend, str(device))
    if key not in _logged:
        _logged.add(key)
        logger.info(
            "DeepInfer V4.1 %s kernels: %s (%s)%s",
            _LABELS.get(family, family),
            backend,
            why,
            _notes(family, backend, device),
        )
    return backend


def chosen() -> list[tuple[str, str, str]]:
    """Every (family, backend, device) chosen in this process so far (for tests and logs)."""
    return sorted(_logged)


class KernelOp:
    """One operator with a reference and device implementations (vLLM's ``CustomOp`` shape).

    Subclasses set ``name`` and ``family`` and define ``forward_native``, and where kernels
    exist ``forward_triton`` / ``forward_npu``; an implementation a backend lacks falls back
    to ``forward_native``. ``kernel_modules`` names, per backend, the module of device
    kernels the implementation calls: it is imported when the operator is built (as
    ``self.kernels``), so a missing kernel library fails at construction, not mid-step.
    ``backend`` is fixed at construction.
    """

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    kernel_modules: ClassVar[dict[str, str]] = {}
    _oot: ClassVar[dict[str, type[KernelOp]]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> KernelOp:  # noqa: PYI034 (may build a registered subclass)
        impl = KernelOp._oot.get(cls.name, cls)
        return super().__new__(impl if issubclass(impl, cls) else cls)

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.backend = choose(self.family, device, dtype)
        self.dtype = dtype
        module = self.kernel_modules.get(self.backend)
        self.kernels = importlib.import_module(module) if module else None
        self._forward: Callable[..., Any] = self._implementation(self.backend)

    def _implementation(self, backend: str) -> Callable[..., Any]:
        method = getattr(self, f"forward_{backend}", None) if backend != "torch" else None
        return method if method is not None else self.forward_native

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, dtype={_dtype_name(self.dtype)})"

    @classmethod
    def register_oot(cls, name: str | None = None) -> Callable[[type[KernelOp]], type[KernelOp]]:
        """Decorator: constructions of the operator ``name`` (default: the decorated class's
        ``name``) build the decorated subclass from now on (a platform's own kernels)."""

        def register(impl: type[KernelOp]) -> type[KernelOp]:
            key = name or impl.name
            if not key:
                raise ValueError(f"{impl.__name__} has no operator name to register under")
            KernelOp._oot[key] = impl
            return impl

        return register
