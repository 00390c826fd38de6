"""``patch.rejection_sampler``: vLLM's CPU fallback of ``expand_kernel`` drops float
values; ours keeps them."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.patch.rejection_sampler import KERNEL, expand_batch_values


@pytest.fixture(scope="module")
def vllm_cpu_kernels():
    """vLLM's C++ kernels (``_C``), loaded as its CPU platform loads them."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()


def test_vllms_cpu_fallback_still_drops_float_values(vllm_cpu_kernels):
    """vLLM 0.32's fallback writes through an int64 copy of the output and never copies back:
    a float output is left as it was. When this fails, vLLM fixed it and the patch can go."""
    import inspect

    from vllm.utils import cpu_triton_utils

    assert "_ensure_int64(output)" in inspect.getsource(cpu_triton_utils._expand_kernel_impl)
    out = torch.full((6,), float("nan"))
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6]), 0, 1)
    assert torch.isnan(out).all()
    ints = torch.zeros(3, dtype=torch.int64)  # int64 outputs are written: the C++ kernel itself is right
    cpu_triton_utils._expand_kernel_impl(ints, torch.tensor([4, 9]), torch.tensor([1, 3]), 0, 0)
    assert ints.tolist() == [4, 9, 9]


def test_the_patched_kernel_is_the_one_the_rejection_sampler_launches():
    from vllm.v1.sample import rejection_sampler

    module, name = KERNEL.rsplit(".", 1)
    assert module == rejection_sampler.__name__ and hasattr(rejection_sampler, name)


def test_expand_kernel_fix_keeps_float_values():
    """vLLM 0.32's CPU fallback writes float temperatures through an int64 copy (never back);
    ours repeats each request's value over its tokens in the output's dtype."""
    out = torch.full((6,), float("nan"))
    expand_batch_values(out, torch.tensor([0.7, -1.0, 1.3]), torch.tensor([2, 5, 6]), -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    ints = torch.zeros(3, dtype=torch.int64)
    expand_batch_values(ints, torch.tensor([4, 9]), torch.tensor([1, 3]), 0, 0)
    assert ints.tolist() == [4, 9, 9]


APPLIED = """
import torch
import vllm.v1.sample.rejection_sampler as rejection_sampler
from vllm.platforms.cpu import CpuPlatform
from vllm.triton_utils import HAS_TRITON

from deepinfer_vllm.patch import rejection_sampler as patch

assert not HAS_TRITON
CpuPlatform.import_kernels()
CpuPlatform.register_triton_kernel_overrides()
for _ in range(2):  # idempotent
    patch.apply()
out = torch.full((6,), float("nan"))
rejection_sampler.expand_kernel[(3,)](
    out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6]), 0, 1, MAX_NUM_TOKENS=6
)
print(out.tolist())
"""


def test_apply_replaces_vllms_fallback():
    """After vLLM's CPU fallbacks (``CpuPlatform.register_triton_kernel_overrides``), the
    rejection sampler's ``expand_kernel`` launch writes float values. In a fresh process: the
    override registry rebinds the kernel everywhere it is referenced."""
    import json
    import subprocess
    import sys

    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("a Triton backend runs the kernel here; the patch applies only without one")
    run = subprocess.run([sys.executable, "-c", APPLIED], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
