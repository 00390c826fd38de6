"""ops/triton/swiglu.py (``ops.moe.SwiGlu``'s kernel) against the reference expression
``(swiglu_clamped(gate, up, limit) * row_weight[:, None]).to(out_dtype)``.

The kernel performs the reference's fp32 operations one by one (clamps, ``g / (1 + exp(-g))``
with an IEEE division, the products, one rounding to nearest even), so it is bit-exact wherever
its ``exp`` gives the reference's bits:

* on the GPU, libdevice's ``expf`` is the CUDA math library's, which torch's SiLU kernel calls:
  every output bit-exact. ``test_silu_every_bf16_gate`` checks SiLU on all 65280 finite bf16
  gate values (an fp32 output, ``up = 1``): gate/up are bf16, so that covers every value SiLU
  can see, and the rest is IEEE products and the final rounding;
* under ``TRITON_INTERPRET=1`` (CPU, small shapes) the kernel's correctly rounded ``exp`` equals
  glibc's, i.e. torch's scalar CPU SiLU, which the batch-invariant reference uses
  (``ops.numerics.pointwise``): bit-exact against it. Against the plain CPU reference, whose
  SIMD SiLU differs from its scalar one by a few fp32 ulps on some gate values, the outputs are
  identical wherever the two torch paths agree, and within one bf16 ulp elsewhere: a difference
  of a few fp32 ulps (2^-21 relative, far below half a bf16 ulp, 2^-9) can move the rounded
  result across at most one bf16 rounding boundary, as rounding is monotone.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET, poison_, shapes

from deepinfer_vllm.ops import moe
from deepinfer_vllm.ops.triton import swiglu as kernel

LIMIT = 10.0  # Flash's swiglu_limit
# (rows, width): decode and prefill rows of Flash's experts (moe_intermediate_size 2048, and
# its per-rank widths under tensor parallelism), odd sizes for the masks
CASES = shapes(
    [(0, 64), (1, 64), (5, 96), (3, 2048)], [(1, 2048), (64, 2048), (384, 1024), (4096, 512), (7, 1000)]
)


@pytest.fixture
def reference_mode(monkeypatch):
    """Under the interpreter the reference SiLU runs torch's scalar kernel (batch-invariant
    mode), whose bits the kernel's correctly rounded ``exp`` reproduces; the GPU reference as is."""
    if INTERPRET:
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def reference(gate, up, limit, row_weight=None, out_dtype=torch.bfloat16):
    act = moe.swiglu_clamped(gate, up, limit)
    if row_weight is not None:
        act = act * row_weight.to(act.dtype).unsqueeze(-1)
    return act.to(out_dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 ``a`` and ``b`` apart in bf16 steps (over zero too; both finite)."""

    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def gate_up(T: int, W: int, device, seed: int, scale: float = 6.0):
    """The gate/up GEMM's output ``[T, 2W]`` (bf16) and its two halves (strided views)."""
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(T, 2 * W, generator=g) * scale).bfloat16().to(device)
    return both, *both.split(W, dim=-1)


def test_silu_every_bf16_gate(reference_mode, device):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = bits[torch.isfinite(bits)].view(255, 256).to(device)
    up = torch.ones_like(gate)
    got = kernel.swiglu(gate, up, None, out_dtype=torch.float32)
    want = reference(gate, up, None, out_dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    got = kernel.swiglu(gate, gate, None)  # and the bf16 rounding of silu(g) * g, subnormals too
    assert torch.equal(got.view(torch.int16), reference(gate, gate, None).view(torch.int16))


@pytest.mark.parametrize("weighted", [False, True], ids=["shared", "routed"])
@pytest.mark.parametrize("limit", [None, LIMIT, 2.0], ids=["no-limit", "limit10", "limit2"])
@pytest.mark.parametrize("T,W", CASES)
def test_bit_exact(T, W, limit, weighted, reference_mode, device):
    _, gate, up = gate_up(T, W, device, seed=T + W)
    g = torch.Generator().manual_seed(W)
    w = (torch.rand(T, generator=g) * 2.5).to(device) if weighted else None
    got = kernel.swiglu(gate, up, limit, w)
    want = reference(gate, up, limit, w)
    assert got.dtype == torch.bfloat16 and got.shape == (T, W) and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the fp32 activation itself (rounding hides most fp32 differences): every bit too
    got = kernel.swiglu(gate, up, limit, w, torch.float32)
    assert torch.equal(got.view(torch.int32), reference(gate, up, limit, w, torch.float32).view(torch.int32))
    if limit == 2.0 and T:
        assert (gate > limit).any() and (up.abs() > limit).any()  # the clamps mattered


def test_strides_and_dtypes(reference_mode, device):
    _, gate, up = gate_up(9, 160, device, seed=3)
    w = torch.rand(9, device=device, dtype=torch.float64)  # cast to fp32 first, as the reference
    cases = [
        (gate, up),  # halves of one tensor (row stride 2W)
        (gate.contiguous(), up.contiguous()),
        (gate.t().contiguous().t(), up),  # column stride != 1
        (gate[:8:2], up[1::2]),  # every other row
    ]
    for a, b in cases:
        got, want = kernel.swiglu(a, b, LIMIT, w[: a.shape[0]]), reference(a, b, LIMIT, w[: a.shape[0]])
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for out in (torch.float32, torch.float16):
        assert torch.equal(kernel.swiglu(gate, up, LIMIT, w, out), reference(gate, up, LIMIT, w, out))
    a, b = gate.half(), up.half()
    want = reference(a, b, 2.0, None, torch.float16)
    assert torch.equal(kernel.swiglu(a, b, 2.0, None, torch.float16), want)
    g3, u3 = gate.reshape(3, 3, 160), up.reshape(3, 3, 160)  # leading dims
    assert torch.equal(kernel.swiglu(g3, u3, LIMIT, w.view(3, 3)), reference(g3, u3, LIMIT, w.view(3, 3)))


def test_every_element_is_written(reference_mode, device):
    _, gate, up = gate_up(37, 300, device, seed=5)
    poison_(torch.empty(37 * 300, dtype=torch.bfloat16, device=device))  # freed: likely the next block
    got = kernel.swiglu(gate, up, LIMIT)
    assert torch.equal(got, reference(gate, up, LIMIT))


@pytest.mark.parametrize("live", [0, 1, 17, 37, 50])
def test_live_rows_only(live, reference_mode, device):
    """``live_rows``: the rows before it bit for bit as without it (the rest are unspecified)."""
    _, gate, up = gate_up(37, 300, device, seed=6)
    w = torch.rand(37, device=device)
    want = reference(gate, up, LIMIT, w)
    got = kernel.swiglu(gate, up, LIMIT, w, live_rows=torch.tensor([live], device=device))
    n = min(live, 37)
    assert torch.equal(got[:n].view(torch.int16), want[:n].view(torch.int16))


@pytest.mark.parametrize("T,W", [(5, 128), (64, 2304)] if not INTERPRET else [(5, 128), (3, 384)])
def test_tile_order(T, W, reference_mode, device):
    """``tile_order=True``: every 128-column tile of the output in the GPU GEMMs' staging order
    (``quant_gemm.to_tile_order``), the bits of the plain output; every element written."""
    from deepinfer_vllm.ops.quant_gemm import to_tile_order

    _, gate, up = gate_up(T, W, device, seed=7)
    w = torch.rand(T, device=device)
    poison_(torch.empty(T * W, dtype=torch.bfloat16, device=device))
    got = kernel.swiglu(gate, up, LIMIT, w, tile_order=True)
    want = to_tile_order(reference(gate, up, LIMIT, w))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_plain_cpu_reference_within_one_ulp(device):
    """Against the default reference (on the CPU: torch's SIMD SiLU for most elements)."""
    T, W = (64, 2048) if not INTERPRET else (16, 512)
    _, gate, up = gate_up(T, W, device, seed=11)
    w = torch.rand(T, device=device) * 2.5
    got = kernel.swiglu(gate, up, LIMIT, w)
    want = reference(gate, up, LIMIT, w)
    assert bool((ulps_apart(got, want) <= 1).all())
    g = torch.clamp(gate.float(), max=LIMIT)
    lanes = g.new_empty(g.numel(), 2)
    lanes[:, 0] = g.reshape(-1)
    scalar = torch.nn.functional.silu(lanes[:, 0]).view(T, W)
    same = torch.nn.functional.silu(g) == scalar  # torch's two SiLU paths agree here
    assert torch.equal(got[same], want[same])
    if not INTERPRET:
        assert same.all() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_operator(dtype, monkeypatch, device):
    """``SwiGlu`` picks the kernel for bf16 models only (fp32 models: fp64 islands, the
    reference); its two implementations agree; gate/up the kernel does not take fall back."""
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    if INTERPRET:
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    op = moe.SwiGlu(device, dtype)
    native = type(op).forward_native
    assert op._forward.__func__ is (type(op).forward_triton if dtype == torch.bfloat16 else native)
    _, gate, up = gate_up(6, 128, device, seed=2)
    w = torch.rand(6, device=device)
    assert torch.equal(op(gate, up, LIMIT, w, torch.bfloat16), reference(gate, up, LIMIT, w))
    a, b = gate.float(), up.float()  # fp32 gate/up: fp64 arithmetic, the reference
    assert torch.equal(op(a, b, LIMIT, w, torch.float32), reference(a, b, LIMIT, w, torch.float32))


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_equals_eager(device):
    both, gate, up = gate_up(64, 2048, device, seed=7)
    w = torch.rand(64, device=device)
    kernel.swiglu(gate, up, LIMIT, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.swiglu(gate, up, LIMIT, w)
    new, _, _ = gate_up(64, 2048, device, seed=8)
    both.copy_(new)
    w.copy_(torch.rand(64, device=device))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, reference(gate, up, LIMIT, w))
