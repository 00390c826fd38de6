"""``ops/npu.py`` on an Ascend NPU against the references (device-only, outside CI; needs
``torch_npu`` and an NPU: ``pytest tests/npu``). NEVER RUN: this project has no NPU. The
tolerances are what the operators' documented numerics imply; a first run on a 950 is what
would confirm them."""

from __future__ import annotations

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")
if not torch.npu.is_available():  # torch.npu exists once torch_npu is imported
    pytest.skip("no NPU visible", allow_module_level=True)

from deepinfer_vllm.ops import npu  # noqa: E402
from deepinfer_vllm.ops.norm import rms_norm  # noqa: E402
from deepinfer_vllm.ops.rope import apply_rope_tail, build_rope_cache  # noqa: E402

DEV = "npu"
BF16_ULP = 2.0**-7


@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_rms_norm(rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 4096, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(4096, generator=g).to(torch.bfloat16)
    got = npu.rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    ref = rms_norm(x, w, 1e-6)
    # fp32 statistics in both, one rounding: within one bf16 ulp, nearly all identical.
    assert ((got.float() - ref.float()).abs() <= BF16_ULP * ref.float().abs()).all()
    assert (got == ref).float().mean() >= 0.99


@pytest.mark.parametrize("shape", [(64, 512), (64, 64, 512), (4096, 128, 192)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail(shape, inverse):
    """The operator reads the layout ``rope_tail`` passes (tokens on S of SBND, heads on B,
    S11D tables) as meant: a 4096-token prefill of 128 heads (4096 x 128 is past the 1000
    bound that tokens on B would hit) gives the reference's values."""
    g = torch.Generator().manual_seed(7)
    cache = build_rope_cache(64, 65536, 10000.0)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 65536, shape[:1], generator=g)
    got = npu.rope_tail(x.to(DEV), positions.to(DEV), cache.to(DEV), inverse=inverse).cpu()
    ref = apply_rope_tail(x, positions, cache, inverse=inverse)
    # The reference's products and sums in fp32 (FMA contraction may move the last fp32 bit),
    # one rounding to bf16.
    assert torch.equal(got[..., :-64], ref[..., :-64])
    assert ((got.float() - ref.float()).abs() <= BF16_ULP * ref.float().abs() + 1e-6).all()
