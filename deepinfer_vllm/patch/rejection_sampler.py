"""vLLM's rejection sampler on CPU: ``expand_kernel`` that keeps float values.

**vLLM behaviour (0.32).** Without a Triton backend, vLLM's CPU platform
(``CpuPlatform.register_triton_kernel_overrides``) replaces the rejection sampler's
Triton kernels (``vllm/v1/sample/rejection_sampler.py``) by C++ fallbacks
(``vllm/utils/cpu_triton_utils.py``). The fallback of ``expand_kernel``,
``_expand_kernel_impl``, hands ``_C.expand_kernel_impl`` int64 copies of its tensors
(``_ensure_int64(output)``) and never copies the result back into a float output.

**Why it is wrong.** The rejection sampler expands each request's temperature (and
top-p) over its draft tokens with ``expand_kernel`` into a float tensor: on CPU those
values are never written, so verification of random requests samples from garbage
(NaN) distributions. Any model's speculative decoding on CPU is affected, V4.1 with
DSpark included.

**What the patch does.** ``apply()`` registers :func:`expand_batch_values` (the kernel
in torch, any dtype) for ``vllm.v1.sample.rejection_sampler.expand_kernel`` through
vLLM's kernel override registry (``vllm.triton_utils.dispatcher.register_kernels``),
after vLLM's CPU fallbacks; vLLM logs "expand_kernel is already registered.
Overwriting." once per worker. Nothing is done where a Triton backend runs the kernel.

**Applied** in each CPU worker process, when vLLM calls the platform's
``register_triton_kernel_overrides`` (``DeepInferCpuPlatform``), for every model.

**Removable** when vLLM's C++ fallback writes float outputs
(``tests/patch/test_rejection_sampler.py`` calls it and fails then).
"""

from __future__ import annotations

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_batch_values(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """``expand_kernel`` of vLLM's rejection sampler in torch, any dtype: request ``i``'s
    value (``replace_from`` mapped to ``replace_to``) repeated over its tokens."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def apply() -> None:
    """Register :func:`expand_batch_values` for ``expand_kernel`` where no Triton backend
    runs (after vLLM's CPU fallbacks). Idempotent: registering again replaces the entry."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_batch_values})
