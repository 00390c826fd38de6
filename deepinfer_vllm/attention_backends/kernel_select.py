"""Which kernels run V4.1's hot paths (attention, weight GEMMs, the fused per-token chains),
chosen per device and logged once.

The PyTorch reference path (``None`` here) runs everywhere and is what every
kernel is tested against. On CUDA devices the backend uses our Triton kernels
(``ops/triton``). DeepSeek's kernel libraries (``flash_mla``, ``deep_gemm``,
``deep_select``) are detected and reported; their V4.1 entry points target
SM100 and are not wired here (no device to test them on), so on Hopper the
Triton kernels are the fast path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch

from deepinfer_vllm import envs

logger = logging.getLogger(__name__)

VENDOR_LIBRARIES = ("flash_mla", "deep_gemm", "deep_select")

_logged: set[tuple[str, ...]] = set()


def vendor_libraries() -> list[str]:
    """Names of DeepSeek's kernel libraries importable in this environment."""
    return [name for name in VENDOR_LIBRARIES if importlib.util.find_spec(name) is not None]


def _gluon_note(choice: str, device: torch.device) -> str:
    """Sparse MLA decode runs the warp-specialised Gluon kernel on sm90 (bf16, D = 512)."""
    if choice != "triton" or device.type != "cuda":
        return ""
    from deepinfer_vllm.ops.triton.sparse_mla_decode_gluon import GLUON_AVAILABLE

    if GLUON_AVAILABLE and torch.cuda.get_device_capability(device) == (9, 0):
        return "; sparse MLA decode: warp-specialised Gluon kernel (sm90)"
    return ""


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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


def choose_attention_kernels(device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (``DEEPINFER_ATTENTION_KERNELS``)."""
    mode = envs.attention_kernels()
    if mode == "torch":
        choice, why = "torch", "DEEPINFER_ATTENTION_KERNELS=torch"
    elif mode == "triton":
        choice, why = "triton", _forced_triton("DEEPINFER_ATTENTION_KERNELS", device)
    elif device.type == "cuda" and _triton_available():
        choice, why = "triton", f"CUDA device {torch.cuda.get_device_name(device)}"
    else:
        choice, why = "torch", f"{device.type} device"
    key = (choice, str(device))
    if key not in _logged:
        _logged.add(key)
        vendors = vendor_libraries()
        vendor_note = (
            f"; found {', '.join(vendors)} (their V4.1 paths target SM100 and are not wired; using ours)"
            if vendors and choice == "triton"
            else ""
        )
        logger.info(
            "DeepInfer V4.1 attention kernels: %s (%s)%s%s",
            choice,
            why,
            _gluon_note(choice, device),
            vendor_note,
        )
    return choice


def _auto_for_bf16(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """``auto``'s choice for kernels of bf16 models: Triton on CUDA devices, else the reference."""
    if device.type == "cuda" and _triton_available() and dtype == torch.bfloat16:
        return "triton", f"CUDA device {torch.cuda.get_device_name(device)}, bf16"
    return "torch", f"{device.type} device, {str(dtype).removeprefix('torch.')}"


def _log_once(what: str, choice: str, why: str, device: torch.device) -> str:
    key = (what, choice, str(device))
    if key not in _logged:
        _logged.add(key)
        logger.info("DeepInfer V4.1 %s kernels: %s (%s)", what, choice, why)
    return choice


def choose_gemm_kernels(device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for the weight GEMMs of a model computing in ``dtype`` on
    ``device`` (``DEEPINFER_GEMM_KERNELS``). The kernels take bf16 activations; fp32 models
    keep the reference, which accumulates in fp64, and so does batch-invariant mode in
    ``auto`` (the kernels' tiles depend on the number of rows)."""
    mode = envs.gemm_kernels()
    if mode == "torch":
        choice, why = "torch", "DEEPINFER_GEMM_KERNELS=torch"
    elif mode == "triton":
        why = _forced_triton("DEEPINFER_GEMM_KERNELS", device)
        if dtype != torch.bfloat16:
            raise RuntimeError(
                f"DEEPINFER_GEMM_KERNELS=triton needs a bfloat16 model (got {dtype}); "
                "fp32 models run the fp64-accumulating reference GEMMs"
            )
        choice = "triton"
    elif envs.batch_invariant():
        # The kernels pick tiles and K splits by M; the reference's fixed row tiles do not.
        choice, why = "torch", "DEEPINFER_BATCH_INVARIANT=1"
    else:
        choice, why = _auto_for_bf16(device, dtype)
    return _log_once("GEMM", choice, why, device)


def _torch_npu_importable() -> bool:
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None
    return importlib.util.find_spec("torch_npu") is not None


def choose_fused_kernels(device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"``, ``"npu"`` or ``"torch"`` for the per-token chains of a model computing in
    ``dtype`` on ``device`` (``DEEPINFER_FUSED_KERNELS``): Triton runs the mHC sites, RMSNorm
    and RoPE; ``npu`` runs RMSNorm and RoPE on ``torch_npu``'s fused operators (``ops.npu``;
    the mHC sites keep the reference). fp32 models keep the reference in ``auto`` (the
    kernels' summation order is not the reference's)."""
    mode = envs.fused_kernels()
    if mode == "torch":
        choice, why = "torch", "DEEPINFER_FUSED_KERNELS=torch"
    elif mode == "triton":
        choice, why = "triton", _forced_triton("DEEPINFER_FUSED_KERNELS", device)
    elif mode == "npu":
        if not _torch_npu_importable():
            raise RuntimeError(
                "DEEPINFER_FUSED_KERNELS=npu needs torch_npu (pip install 'deepinfer-vllm[ascend]')"
            )
        choice, why = "npu", "DEEPINFER_FUSED_KERNELS=npu"
    elif device.type == "npu" and dtype == torch.bfloat16:
        choice, why = "npu", "NPU device, bf16"
    else:
        choice, why = _auto_for_bf16(device, dtype)
    return _log_once("fused", choice, why, device)
