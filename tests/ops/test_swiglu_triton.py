"""The MoE's clamped SwiGLU: ``ops.moe.SwiGlu``'s reference equals the expressions the layers
computed before it, bit for bit, and its kernel (``ops/triton/swiglu.py``) equals the reference
on the CPU under Triton's interpreter, small shapes.

Under the interpreter the kernel's ``exp`` is correctly rounded, which equals glibc's ``expf``,
torch's scalar SiLU: bit-exact against the batch-invariant reference (``ops.numerics.pointwise``
runs that scalar kernel), on every bf16 gate value and on the layer's outputs. Against the plain
reference, whose SIMD SiLU differs from the scalar one by a few fp32 ulps on some gate values:
identical wherever torch's two paths agree, within one bf16 ulp elsewhere (a few fp32 ulps move
a value across at most one bf16 rounding boundary). ``tests/gpu/test_swiglu.py`` checks
bit-exactness on the GPU (libdevice's ``expf`` is the one torch's CUDA SiLU calls).

The kernels run under the interpreter in a subprocess (``tests/ops/interpreted.py``). The layer
with the kernel (the grouped path, every fused operator on Triton) is compared with the reference
layer in ``tests/ops/test_routing_triton.py``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import moe
from deepinfer_vllm.ops.numerics import acc_dtype
from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted

LIMIT = 10.0


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_kernels_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def K():
    return interpreted_module("deepinfer_vllm.ops.triton.swiglu")


@pytest.fixture
def scalar_silu(monkeypatch):
    """The reference's SiLU on torch's scalar kernel (batch-invariant mode)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _gate_up(T: int, W: int, seed: int, scale: float = 6.0):
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(T, 2 * W, generator=g) * scale).bfloat16()
    return both.split(W, dim=-1)  # the GEMM output's two halves: strided views


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ----------------------------------------------------------------------- the reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [None, LIMIT, 2.0])
def test_reference_is_the_layers_former_expression(dtype, limit):
    op = moe.SwiGlu("cpu", dtype)
    assert op.backend == "torch"  # a CPU device: the reference
    gate, up = (t.to(dtype) for t in _gate_up(7, 48, seed=1))
    w = torch.rand(7, generator=torch.Generator().manual_seed(2)) * 2.5  # fp32 routing weights
    acc = acc_dtype(dtype)
    # SharedExpert.forward: swiglu_clamped(w1 x, w3 x, limit).to(x.dtype)
    old = moe.swiglu_clamped(gate, up, limit).to(dtype)
    assert torch.equal(_bits(op(gate, up, limit, out_dtype=dtype)), _bits(old))
    # RoutedExperts._partial_grouped: (swiglu * weights.to(acc).unsqueeze(-1)).to(x.dtype)
    old = (moe.swiglu_clamped(gate, up, limit) * w.to(acc).unsqueeze(-1)).to(dtype)
    assert torch.equal(_bits(op(gate, up, limit, w, dtype)), _bits(old))
    # RoutedExperts._expert: act * row_w.to(act.dtype).unsqueeze(-1), then .to(x.dtype)
    act = moe.swiglu_clamped(gate, up, limit)
    old = (act * w.to(act.dtype).unsqueeze(-1)).to(dtype)
    assert torch.equal(_bits(op(gate, up, limit, w.to(acc), dtype)), _bits(old))


# ----------------------------------------------------------------------- the kernel


def test_silu_every_bf16_gate(K, scalar_silu):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = bits[torch.isfinite(bits)].view(255, 256)
    one = torch.ones_like(gate)
    got = K.swiglu(gate, one, None, out_dtype=torch.float32)
    assert torch.equal(_bits(got), _bits(moe.swiglu_clamped(gate, one, None)))
    got = K.swiglu(gate, gate, None)  # bf16 rounding by bits, subnormals and overflow included
    assert torch.equal(_bits(got), _bits(moe.swiglu_clamped(gate, gate, None).bfloat16()))


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True], ids=["shared", "routed"])
@pytest.mark.parametrize("limit", [None, LIMIT, 2.0], ids=["no-limit", "limit10", "limit2"])
@pytest.mark.parametrize("T,W", [(0, 64), (1, 64), (5, 96), (3, 2048)])
def test_matches_reference(K, scalar_silu, T, W, limit, weighted, out):
    gate, up = _gate_up(T, W, seed=T + W)
    w = torch.rand(T, generator=torch.Generator().manual_seed(W)) * 2.5 if weighted else None
    got = K.swiglu(gate, up, limit, w, out)
    want = moe.SwiGlu("cpu", torch.bfloat16).forward_native(gate, up, limit, w, out)
    assert got.dtype == out and got.shape == (T, W) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))
    if limit == 2.0 and T:
        assert (gate > limit).any() and (up.abs() > limit).any()  # the clamps mattered


def test_strides_dtypes_and_shapes(K, scalar_silu):
    gate, up = _gate_up(9, 40, seed=3)
    w = torch.rand(9, dtype=torch.float64)  # cast to fp32 first, as the reference does
    ref = moe.SwiGlu("cpu", torch.bfloat16).forward_native
    strided = [(gate.contiguous(), up.contiguous()), (gate.t().contiguous().t(), up), (gate[:8:2], up[1::2])]
    for a, b in strided:
        n = a.shape[0]
        assert torch.equal(_bits(K.swiglu(a, b, LIMIT, w[:n])), _bits(ref(a, b, LIMIT, w[:n])))
    a, b = gate.half(), up.half()
    assert torch.equal(K.swiglu(a, b, 2.0, None, torch.float16), ref(a, b, 2.0, None, torch.float16))
    g3, u3 = gate.reshape(3, 3, 40), up.reshape(3, 3, 40)
    assert torch.equal(K.swiglu(g3, u3, LIMIT, w.view(3, 3)), ref(g3, u3, LIMIT, w.view(3, 3)))
    with pytest.raises(ValueError):
        K.swiglu(gate.float(), up.float(), LIMIT)  # fp32 gate/up: the op keeps the reference
    with pytest.raises(ValueError):
        K.swiglu(gate, up[:, :39], LIMIT)


def test_live_rows(K, scalar_silu):
    gate, up = _gate_up(9, 40, seed=4)
    ref = moe.SwiGlu("cpu", torch.bfloat16).forward_native(gate, up, LIMIT)
    for live in (0, 4, 9, 12):
        got = K.swiglu(gate, up, LIMIT, live_rows=torch.tensor([live]))
        assert torch.equal(_bits(got[:live]), _bits(ref[:live]))


def test_tile_order(K, scalar_silu):
    """``tile_order=True`` (the routed experts' activation when the down projection stages it in the GPU
    GEMMs' order): each 128-column tile of the output in ``quant_gemm.tile_order_columns``'s order, the same
    bits."""
    from deepinfer_vllm.ops.quant_gemm import tile_order_columns

    gate, up = _gate_up(7, 384, seed=5)
    w = torch.rand(7, generator=torch.Generator().manual_seed(6)) * 2.5
    ref = moe.SwiGlu("cpu", torch.bfloat16).forward_native
    plain = ref(gate, up, LIMIT, w)
    cols = (torch.arange(3)[:, None] * 128 + tile_order_columns()[None, :]).flatten()
    for got in (K.swiglu(gate, up, LIMIT, w, tile_order=True), ref(gate, up, LIMIT, w, tile_order=True)):
        assert torch.equal(_bits(got), _bits(plain[:, cols]))
    live = K.swiglu(gate, up, LIMIT, w, live_rows=torch.tensor([3]), tile_order=True)
    assert torch.equal(_bits(live[:3]), _bits(plain[:3, cols]))
    with pytest.raises(ValueError, match="multiple of 128"):
        K.swiglu(gate[:, :96], up[:, :96], LIMIT, tile_order=True)


def test_plain_reference_within_one_ulp(K):
    T, W = 16, 512
    gate, up = _gate_up(T, W, seed=11)
    w = torch.rand(T, generator=torch.Generator().manual_seed(12)) * 2.5
    got = K.swiglu(gate, up, LIMIT, w)
    want = moe.SwiGlu("cpu", torch.bfloat16).forward_native(gate, up, LIMIT, w)

    def ordered(t):  # bf16 bits as integers in value order
        b = _bits(t).to(torch.int32)
        return torch.where(b < 0, -(b & 0x7FFF), b)

    assert int((ordered(got) - ordered(want)).abs().max()) <= 1
    g = torch.clamp(gate.float(), max=LIMIT)
    lanes = g.new_empty(g.numel(), 2)
    lanes[:, 0] = g.reshape(-1)
    same = torch.nn.functional.silu(g) == torch.nn.functional.silu(lanes[:, 0]).view(T, W)
    assert same.float().mean() > 0.9
    assert torch.equal(got[same], want[same])


# ----------------------------------------------------------------------- the operator


def test_operator_picks_the_kernel_for_bf16_only(K, monkeypatch, scalar_silu):
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    op = moe.SwiGlu("cpu", torch.bfloat16)
    assert op._forward.__func__ is moe.SwiGlu.forward_triton
    assert moe.SwiGlu("cpu", torch.float32)._forward.__func__ is moe.SwiGlu.forward_native
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "torch")
    assert moe.SwiGlu("cpu", torch.bfloat16)._forward.__func__ is moe.SwiGlu.forward_native
    gate, up = _gate_up(6, 64, seed=4)
    w = torch.rand(6)
    assert torch.equal(op(gate, up, LIMIT, w, torch.bfloat16), op.forward_native(gate, up, LIMIT, w))
    a, b = gate.float(), up.float()  # not the kernel's dtypes: the reference
    assert torch.equal(op(a, b, LIMIT, w, torch.float32), op.forward_native(a, b, LIMIT, w, torch.float32))
