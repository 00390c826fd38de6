"""ops/quant_gemm.py: the references of the FP8 dense and grouped FP4 expert GEMMs (CPU).

Each reference against an independent float64 computation built from the ``ops.quant``
element decoders (e4m3 / e2m1 values times UE8M0 powers of two, expanded by hand), within
the fp32 summation bound; ``fp8_block_gemm(act="bf16")`` against the model's
``gemm_fp8`` within one bf16 ulp; the grouped reference's row grouping and zero tail.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.quant_gemm import activations, fp8_block_gemm, grouped_fp4_gemm
from deepinfer_vllm.ops.weight_gemm import gemm_fp8


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = (
        torch.exp2(torch.randint(-4, 5, (m, k // 32, 1), generator=g).float())
        .expand(m, k // 32, 32)
        .reshape(m, k)
    )
    return (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)


def _fp8_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    v, s = quant.quant_fp8_block(torch.randn(n, k, generator=g) * 0.05)
    return v.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def _fp4_weights(e: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    v, s = quant.quant_fp4_rows(torch.randn(e, n, k, generator=g) * 0.05)
    return v.view(torch.int8), s.view(torch.float8_e8m0fnu)


def _fp8_weight_f64(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    vals = quant.e4m3_decode(v).double()
    sc = quant.ue8m0_decode(s).double()
    return vals * sc.repeat_interleave(32, 0).repeat_interleave(32, 1)


def _fp4_weight_f64(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    vals = quant.e2m1_decode(quant.unpack_fp4(v)).double()
    return vals * quant.ue8m0_decode(s).double().repeat_interleave(32, -1)


def _x_f64(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "bf16":
        return x.double()
    v, s = quant.mxfp8_quantize(x)
    return quant.e4m3_decode(v).double() * quant.ue8m0_decode(s).double().repeat_interleave(32, -1)


def _assert_close(got: torch.Tensor, want64: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor) -> None:
    k = w64.shape[-1]
    bound = 2e-6 * k * (x64.abs() @ w64.abs().t()) + 1e-30
    assert ((got.double() - want64).abs() <= bound).all()


@pytest.mark.parametrize("act", ["bf16", "mxfp8"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (17, 96, 256), (40, 128, 512)])
def test_fp8_block_gemm_against_float64(act, m, n, k):
    x = _x(m, k, seed=m)
    v, s = _fp8_weight(n, k, seed=n + k)
    w64 = _fp8_weight_f64(v, s)
    x64 = _x_f64(x, act)
    assert torch.equal(activations(x, act).double(), x64)
    got = fp8_block_gemm(x, v, s, act, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    _assert_close(got, x64 @ w64.t(), x64, w64)
    assert fp8_block_gemm(x, v, s, act).dtype == torch.bfloat16


def test_fp8_block_gemm_bf16_matches_gemm_fp8():
    x = _x(33, 512, seed=1)
    v, s = _fp8_weight(160, 512, seed=2)
    ours = fp8_block_gemm(x, v, s, "bf16").float()
    model = gemm_fp8(x, v, s).float()
    exact = x.double() @ _fp8_weight_f64(v, s).t()
    _, e = torch.frexp(exact.abs())
    ulp = torch.exp2((e - 8).double())
    assert ((ours.double() - model.double()).abs() <= ulp).all()


@pytest.mark.parametrize("act", ["bf16", "mxfp8"])
def test_grouped_fp4_gemm_against_float64(act):
    e, n, k, r = 5, 64, 256, 30
    x = _x(r, k, seed=3)
    v, s = _fp4_weights(e, n, k, seed=4)
    offsets = torch.tensor([0, 4, 4, 15, 16, 26], dtype=torch.int64)  # expert 1 empty, 4 rows past the end
    got = grouped_fp4_gemm(x, offsets, v, s, act, torch.float32)
    x64 = _x_f64(x, act)
    w64 = _fp4_weight_f64(v, s)
    o = offsets.tolist()
    for i in range(e):
        rows = slice(o[i], o[i + 1])
        _assert_close(got[rows], x64[rows] @ w64[i].t(), x64[rows], w64[i])
    assert torch.equal(got[o[-1] :], torch.zeros(r - o[-1], n))
    assert grouped_fp4_gemm(x, offsets.int(), v, s, act).dtype == torch.bfloat16


def test_grouped_fp4_gemm_tile_ordered_x():
    """``x_tile_ordered=True``: ``x``'s columns come in the staging order (``to_tile_order``); the same
    result, with and without ``rows`` and with the MXFP8 round trip (of ``x`` in its own order).
    ``from_tile_order`` inverts ``to_tile_order``."""
    from deepinfer_vllm.ops.quant_gemm import from_tile_order, tile_order_columns, to_tile_order

    cols = tile_order_columns()
    assert torch.equal(cols.sort().values, torch.arange(128))
    assert torch.equal(cols // 32, (torch.arange(128) // 2) % 4)  # place p: a column of block (p // 2) % 4
    e, n, k, r = 3, 32, 256, 12
    x = _x(r, k, seed=7)
    assert torch.equal(from_tile_order(to_tile_order(x)), x)
    assert torch.equal(to_tile_order(x)[:, 128 + 16], x[:, 128 + int(cols[16])])
    v, s = _fp4_weights(e, n, k, seed=8)
    offsets = torch.tensor([0, 3, 3, 10], dtype=torch.int64)
    rows = torch.randperm(r, generator=torch.Generator().manual_seed(9))
    for act in ("bf16", "mxfp8"):
        for rw in (None, rows):
            want = grouped_fp4_gemm(x, offsets, v, s, act, torch.float32, rows=rw)
            got = grouped_fp4_gemm(
                to_tile_order(x), offsets, v, s, act, torch.float32, rows=rw, x_tile_ordered=True
            )
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="multiple of 128"):
        to_tile_order(x[:, :64])


def test_grouped_fp4_gemm_rejects_bad_offsets():
    v, s = _fp4_weights(2, 32, 64, seed=5)
    x = _x(4, 64, seed=6)
    with pytest.raises(ValueError):
        grouped_fp4_gemm(x, torch.tensor([0, 3, 2]), v, s)
    with pytest.raises(ValueError):
        grouped_fp4_gemm(x, torch.tensor([0, 3, 5]), v, s)
    with pytest.raises(ValueError):
        activations(x, "fp4")


@pytest.mark.parametrize(
    "op_name,module,name,message",
    [
        (
            "moe.GroupedExpertGemm",
            "moe_gemm",
            "experts.3.w1.scale",
            r"experts\.3\.w1\.scale: UE8M0 scale 2\^2 exceeds 2\^1",
        ),
        (
            "weight_gemm.Fp8BlockGemm",
            "fp8_gemm",
            "layers.0.attn.wq_a.scale",
            r"layers\.0\.attn\.wq_a\.scale: UE8M0 scale 2\^8 exceeds 2\^7",
        ),
    ],
)
def test_gemm_refuses_scales_its_kernel_cannot_decode(op_name, module, name, message):
    """Each GPU kernel decodes scale bytes up to its module's ``MAX_SCALE_BYTE`` exactly (the expert
    kernel 2^1, the dense Gluon kernel 2^7); a checkpoint tensor with a larger one is refused while
    loading, by name. The reference takes any."""
    import importlib

    owner, cls = op_name.split(".")
    op = getattr(importlib.import_module(f"deepinfer_vllm.ops.{owner}"), cls)("cpu", torch.bfloat16)
    assert op.backend == "torch"
    big = torch.full((4, 2), 200, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    op.check_scales(big, name)  # the reference: no limit
    op.kernels = importlib.import_module(f"deepinfer_vllm.ops.triton.{module}")  # as on a CUDA device
    ok = torch.full((4, 2), op.kernels.MAX_SCALE_BYTE, dtype=torch.uint8)
    op.check_scales(ok.view(torch.float8_e8m0fnu), name)
    ok[1, 1] += 1
    with pytest.raises(ValueError, match=message):
        op.check_scales(ok.view(torch.float8_e8m0fnu), name)
