"""Weight GEMMs on the released formats: each decodes its weight when it runs.

Parameters hold the checkpoint's bytes (FP8 E4M3 with 32x32 UE8M0 tiles, packed
E2M1 experts with UE8M0 per 1x32, bf16 / fp32 where the release keeps them).
The references here (``gemm_fp8``, ``gemm_fp4``, ``gemm_stored``) decode a weight into
one process-wide workspace, in the accumulation dtype of the activations
(``ops.numerics.acc_dtype``: fp32 for bf16 models, fp64 for fp32 models), and
multiply. The decoded values are exact, so the products are those of a model holding
dequantised weights; the workspace is reused by every GEMM of every layer, and weights
with many rows are decoded and multiplied a row block at a time, so it never holds more
than ``WORKSPACE_ELEMENTS`` values per decode (splitting the output rows of a GEMM leaves
every output element's sum unchanged). The multiply is ``ops.numerics.matmul`` (fixed row
tiles in batch-invariant mode).

FP8 and FP4 GEMMs take their activations as ``act`` says: ``"bf16"``, as computed, or
``"mxfp8"``, MXFP8-quantised first as DeepInfer does. The operators a layer builds
(``Fp8BlockGemm``, ``Fp8GroupedGemm``, ``Fp4RowsGemm``, ``StoredGemm``) read
``DEEPINFER_GEMM_ACTIVATIONS`` once, when built, and run the references or, where
``ops.dispatch`` picks them (bf16 models on CUDA), the kernels of ``ops/triton/fp8_gemm.py``
(dense FP8; its Gluon decode kernel on sm90) and ``ops/triton/stored_gemm.py`` (bf16 / fp32
weights on bf16 tensor cores, exact products). Imports no vLLM.
"""

from __future__ import annotations

import torch

from deepinfer_vllm import envs

from . import quant
from .dispatch import KernelOp
from .numerics import acc_dtype, matmul

__all__ = [
    "FP8_TILE",
    "ActivationsGemm",
    "WORKSPACE_ELEMENTS",
    "Fp4RowsGemm",
    "Fp8BlockGemm",
    "Fp8GroupedGemm",
    "StoredGemm",
    "Workspace",
    "decode_fp4_rows",
    "decode_fp8_block",
    "decode_stored",
    "gemm_fp4",
    "gemm_fp8",
    "gemm_fp8_grouped",
    "gemm_stored",
    "workspace",
]

# 2**20 values (4 MiB of fp32, 8 MiB of fp64): a decoded block stays in cache
# for its GEMM (benchmarks/README.md, "resident formats": 2**22 made the
# head's decode-and-multiply twice as slow as 2**20).
WORKSPACE_ELEMENTS = 1 << 20
FP8_TILE = 32


class Workspace:
    """One growable buffer per (device, dtype); ``view`` hands out its front.

    Callers use a view before asking for the next one (decode, multiply,
    decode, ...); the buffer only grows, to the largest request made.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= int(s)
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n].view(shape)


workspace = Workspace()


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``[R, C]`` with UE8M0 32x32 tiles -> the workspace, in ``dtype``."""
    out = workspace.view(tuple(weight.shape), dtype, weight.device)
    return quant.dequant_fp8_block_into(out, weight, scale, FP8_TILE)


def decode_fp4_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 ``[R, C/2]`` with UE8M0 per 1x32 -> the workspace ``[R, C]``, in ``dtype``."""
    out = workspace.view((*weight.shape[:-1], 2 * weight.shape[-1]), dtype, weight.device)
    return quant.dequant_fp4_rows_into(out, weight, scale)


def decode_stored(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bf16 / fp32 weight widened into the workspace (the same weight if already ``dtype``)."""
    if weight.dtype == dtype:
        return weight
    return workspace.view(tuple(weight.shape), dtype, weight.device).copy_(weight)


def _row_blocks(rows: int, cols: int, align: int) -> list[tuple[int, int]]:
    """Row ranges whose decoded size fits the workspace (multiples of ``align`` rows)."""
    step = max(align, (WORKSPACE_ELEMENTS // max(cols, 1)) // align * align)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _gemm_blocks(x: torch.Tensor, rows: int, cols: int, align: int, decode, out_dtype) -> torch.Tensor:
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    if rows * cols <= WORKSPACE_ELEMENTS:
        return matmul(xa, decode(0, rows, acc)).to(out_dtype)
    out = torch.empty(*x.shape[:-1], rows, dtype=out_dtype, device=x.device)
    for lo, hi in _row_blocks(rows, cols, align):
        out[..., lo:hi] = matmul(xa, decode(lo, hi, acc)).to(out_dtype)
    return out


def _gemm_input(x: torch.Tensor, act: str) -> torch.Tensor:
    """The activations an FP8 / FP4 weight GEMM multiplies: ``x``, or its MXFP8
    quantise-dequantise (``act="mxfp8"``)."""
    return quant.mxfp8_qdq(x) if act == "mxfp8" else x


def gemm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    act: str = "bf16",
) -> torch.Tensor:
    """``x @ W.T`` for an FP8 block-scaled ``W``: accumulated in ``acc_dtype(x.dtype)``,
    rounded once to ``out_dtype`` (default ``x.dtype``), as ``ops.numerics.gemm``."""
    rows, cols = weight.shape
    x = _gemm_input(x, act)

    def decode(lo, hi, dtype):
        return decode_fp8_block(weight[lo:hi], scale[lo // FP8_TILE : -(-hi // FP8_TILE)], dtype)

    return _gemm_blocks(x, rows, cols, FP8_TILE, decode, out_dtype or x.dtype)


def gemm_fp8_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    act: str = "bf16",
) -> torch.Tensor:
    """Block-diagonal ``gemm_fp8``: ``x [T, G, K]``, group ``g`` times rows ``g*N/G ...`` of
    ``W [N, K]`` -> ``[T, G, N/G]``, a loop over the groups."""
    T, groups, _ = x.shape
    rows = weight.shape[0] // groups
    out = torch.empty(T, groups, rows, dtype=out_dtype or x.dtype, device=x.device)
    for g in range(groups):
        lo = g * rows
        out[:, g] = gemm_fp8(
            x[:, g], weight[lo : lo + rows], scale[lo // FP8_TILE : (lo + rows) // FP8_TILE], out_dtype, act
        )
    return out


def gemm_fp4(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    act: str = "bf16",
) -> torch.Tensor:
    """``x @ W.T`` for a routed expert's packed E2M1 ``W`` (UE8M0 per 1x32), same rules."""
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    x = _gemm_input(x, act)

    def decode(lo, hi, dtype):
        return decode_fp4_rows(weight[lo:hi], scale[lo:hi], dtype)

    return _gemm_blocks(x, rows, cols, 1, decode, out_dtype or x.dtype)


def gemm_stored(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for a bf16 / fp32 ``W``, with the same accumulation and rounding."""
    rows, cols = weight.shape

    def decode(lo, hi, dtype):
        return decode_stored(weight[lo:hi], dtype)

    return _gemm_blocks(x, rows, cols, 1, decode, out_dtype or x.dtype)


class ActivationsGemm(KernelOp):
    """A weight GEMM whose activations follow ``DEEPINFER_GEMM_ACTIVATIONS`` (read when built, as
    ``self.act``): the dense FP8 GEMMs here, the expert GEMMs here and in ``ops.moe``."""

    family = "gemm"

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.act = envs.gemm_activations()

    def check_scales(self, scale: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` when its UE8M0 scale bytes exceed what the chosen kernels
        decode exactly (their module's ``MAX_SCALE_BYTE``; the reference takes any); called once per
        tensor after loading."""
        limit = getattr(self.kernels, "MAX_SCALE_BYTE", None)
        if limit is None or scale.numel() == 0:
            return
        top = int(scale.view(torch.uint8).max())
        if top > limit:
            raise ValueError(
                f"{name}: UE8M0 scale 2^{top - 127} exceeds 2^{limit - 127}, the largest the GPU kernel "
                f"decodes exactly ({self.kernels.__name__}); run this checkpoint with DEEPINFER_GEMM_KERNELS=torch"
            )


class Fp8BlockGemm(ActivationsGemm):
    """``gemm_fp8(x, weight, scale, out_dtype)``: the reference or the Triton kernel."""

    name = "fp8_block_gemm"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.fp8_gemm"}

    def forward_native(self, x, weight, scale, out_dtype=None):
        return gemm_fp8(x, weight, scale, out_dtype, self.act)

    def forward_triton(self, x, weight, scale, out_dtype=None):
        rows, cols = weight.shape
        y = self.kernels.fp8_block_gemm(x.reshape(-1, cols), weight, scale, self.act, out_dtype or x.dtype)
        return y.view(*x.shape[:-1], rows)


class Fp8GroupedGemm(ActivationsGemm):
    """``gemm_fp8_grouped(x, weight, scale, out_dtype)`` (the attention's grouped output
    projection): a loop over the groups, or one launch of the Triton kernel."""

    name = "fp8_grouped_gemm"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.fp8_gemm"}

    def forward_native(self, x, weight, scale, out_dtype=None):
        return gemm_fp8_grouped(x, weight, scale, out_dtype, self.act)

    def forward_triton(self, x, weight, scale, out_dtype=None):
        T, groups, cols = x.shape
        y = self.kernels.fp8_block_gemm(
            x.reshape(T, groups * cols), weight, scale, self.act, out_dtype or x.dtype, groups=groups
        )
        return y.view(T, groups, weight.shape[0] // groups)


class Fp4RowsGemm(ActivationsGemm):
    """``gemm_fp4(x, weight, scale, out_dtype)``: one routed expert at a time (the reference;
    the grouped expert GEMM is ``ops.moe.GroupedExpertGemm``)."""

    name = "fp4_rows_gemm"

    def forward_native(self, x, weight, scale, out_dtype=None):
        return gemm_fp4(x, weight, scale, out_dtype, self.act)


class StoredGemm(KernelOp):
    """``gemm_stored(x, weight, out_dtype)``: bf16 / fp32 weights (the compressor, indexer and
    head GEMMs); the reference, or for bf16 ``x`` the Triton kernel of
    ``ops/triton/stored_gemm.py`` (bf16 tensor cores, an fp32 weight split exactly into three
    bf16 parts: the same fp32 products, summed in another order). Other ``x`` dtypes keep the
    reference."""

    name = "stored_gemm"
    family = "gemm"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.stored_gemm"}

    def forward_native(self, x, weight, out_dtype=None):
        return gemm_stored(x, weight, out_dtype)

    def forward_triton(self, x, weight, out_dtype=None):
        if x.dtype != torch.bfloat16:
            return gemm_stored(x, weight, out_dtype)
        rows, cols = weight.shape
        y = self.kernels.stored_gemm(x.reshape(-1, cols), weight, out_dtype or x.dtype)
        return y.view(*x.shape[:-1], rows)
