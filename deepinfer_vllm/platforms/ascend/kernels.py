"""PyTorch implementations of the Triton kernels vLLM's device runner launches, for the Ascend platform.

The NPU runner is vLLM's ``GPUModelRunner``, whose step launches Triton
kernels. On an Ascend host nothing runs them: the ``ascend`` extra installs
PyPI's vLLM and its CUDA Triton (no triton-ascend), vLLM finds no active
Triton driver (``HAS_TRITON`` is False), and its ``triton.jit`` is a
placeholder, so the first ``kernel[grid](...)`` raises. vLLM 0.32 lets a
platform replace a Triton kernel by name
(``vllm.triton_utils.dispatcher.register_kernels``, called from
``Platform.register_triton_kernel_overrides`` when each worker starts); the
platform registers :data:`KERNEL_OVERRIDES` on the NPU and on the simulated
NPU alike, whether or not a Triton backend is importable.

Replaced (those the V4.1 path reaches: every step, and speculative decoding
with DSpark, greedy or sampled, seeded or not):

* ``block_table.ComputeSlotMappingKernel.kernel``: the KV-cache slot of every
  scheduled token (:func:`compute_slot_mapping_kernel`);
* ``rejection_sampler.rejection_greedy_sample_kernel`` and
  ``rejection_random_sample_kernel``: verification of the drafts;
  ``expand_kernel``: per-request sampling parameters repeated over their
  draft tokens; ``sample_recovered_tokens_kernel``: the token drawn from the
  residual distribution where a draft is rejected;
* ``topk_topp_sampler.apply_top_k_top_p``: not a kernel, but vLLM's entry
  point to its Triton top-k/top-p whenever ``HAS_TRITON``; replaced by vLLM's
  PyTorch top-k/top-p without a host synchronisation (the sort path, also for
  top-k alone), so where a Triton backend is installed the sampler still
  never reaches it.

:func:`greedy_sample` is vLLM's greedy branch off its CPU platform (the
NPU's), which the simulated NPU's workers also take (the platform's
``_take_the_npu_sampler_branch``).

Not replaced, because the V4.1 path never launches them: the EAGLE/DFlash
input kernels of ``spec_decode/utils.py`` (vLLM's runner calls them only for
its own drafters; DSpark drafts through ``V41RunnerMixin``), the KV-block
zeroer (the NPU runner zeroes with tensor ops) and Mamba's ``batch_memcpy``.
vLLM's ``torch.compile``d sampler helpers (``batched_count_greater_than``,
``update_num_computed_tokens_for_batch_change``) compile with the platform's
``simple_compile_backend``, ``eager`` here: dynamo, never inductor.

vllm-ascend solves the same problem differently: it builds vLLM without CUDA,
installs triton-ascend, and swaps its own sampler classes into its runner
(Triton kernels where triton-ascend runs them, PyTorch fallbacks otherwise,
``torch_npu``'s fused top-k/top-p). Here vLLM's sampler classes stay as they
are and only their kernels are replaced through vLLM's own override registry,
which rebinds every reference to each kernel: the sampling logic (synthetic
acceptance, logprobs modes, per-request generators) remains vLLM's, one code
path serves the NPU and its simulation on CPU tensors (where these functions
are tested against vLLM's C++ kernels), and no Triton backend is needed.

Every function takes the replaced kernel's parameters under the same names
(so the dispatcher forwards the launch by name; the grid is dropped, sizes
come from the tensors), writes its outputs in place as the kernel does and
leaves the rest of each output untouched. All are tensor operations over the
whole batch, with no loop over requests or tokens and no host
synchronisation, on any device. Temporaries: the recovered-token sampler
materialises the residual distribution and each token's noise row, two
``[num_draft_tokens, vocab]`` tensors (the Triton kernel streams the
vocabulary in tiles); the others are ``[batch, max_spec_len]`` or
``[num_tokens]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KERNEL_OVERRIDES",
    "apply_top_k_top_p",
    "compute_slot_mapping_kernel",
    "expand_kernel",
    "greedy_sample",
    "rejection_greedy_sample_kernel",
    "rejection_random_sample_kernel",
    "sample_recovered_tokens_kernel",
]


# ------------------------------------------------------------------ helpers
def _segment_of(index: Tensor, cu_ends: Tensor) -> tuple[Tensor, Tensor]:
    """For each flat ``index``, the segment holding it given each segment's cumulative
    end ``cu_ends`` (non-decreasing, segment ``i`` is ``[cu_ends[i-1], cu_ends[i])``),
    clamped to a valid segment, and whether it lies in any segment."""
    ends = cu_ends.to(torch.int64)
    seg = torch.searchsorted(ends, index, right=True)
    inside = seg < ends.shape[0]
    return seg.clamp(max=max(ends.shape[0] - 1, 0)), inside


def _draft_slots(cu_num_draft_tokens: Tensor, max_spec_len: int, num_tokens: int):
    """Slot ``(request, position)`` view of the flat draft tokens: each request's draft
    count, the flat index of every slot (0 where the slot is empty) and which slots hold
    a draft. No slots at all when there is no draft token."""
    ends = cu_num_draft_tokens.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = ends - starts
    width = max_spec_len if num_tokens > 0 else 0
    pos = torch.arange(width, device=ends.device)
    in_range = pos < counts[:, None]
    index = torch.where(in_range, starts[:, None] + pos, 0).clamp(max=max(num_tokens - 1, 0))
    return counts, index, in_range


def _write_verified(
    output: Tensor,
    rows: Tensor,
    counts: Tensor,
    in_range: Tensor,
    accepted: Tensor,
    tokens: Tensor,
    bonus: Tensor,
) -> None:
    """The verification kernels' output rule for the selected ``rows``: every slot up to
    and including the first rejected one gets its token; a row whose drafts were all
    accepted gets its bonus token right after its last draft."""
    batch, width = in_range.shape
    ok = accepted | ~in_range
    alive_through = torch.cumsum((~ok).to(torch.int32), dim=1) == 0
    alive_before = torch.cat([ok.new_ones(batch, 1), alive_through], dim=1)[:, :width]
    written = in_range & alive_before
    all_accepted = alive_through.all(dim=1)

    cols = torch.arange(output.shape[1], device=output.device)
    write = torch.zeros(output.shape, dtype=torch.bool, device=output.device)
    write[:, :width] = written
    values = torch.zeros_like(output)
    values[:, :width] = tokens.to(output.dtype)
    bonus_at = (cols == counts[:, None]) & all_accepted[:, None]
    values = torch.where(bonus_at, bonus.reshape(-1)[:batch, None].to(output.dtype), values)
    output.copy_(torch.where((write | bonus_at) & rows[:, None], values, output))


# ------------------------------------------------------------------ kernels
def compute_slot_mapping_kernel(
    num_tokens,
    max_num_tokens,
    query_start_loc_ptr,
    positions_ptr,
    block_table_ptr,
    block_table_stride,
    slot_mapping_ptr,
    KV_CACHE_BLOCK_SIZE,
    TOTAL_CP_WORLD_SIZE,
    TOTAL_CP_RANK,
    CP_KV_CACHE_INTERLEAVE_SIZE,
    PAD_ID,
    BLOCK_SIZE,
) -> None:
    """``slot_mapping[t]`` for every token ``t`` of requests ``0..len(query_start_loc)-2``
    (``query_start_loc`` holds each request's first token and the end): the cache slot of
    its position through its request's row of ``block_table``; with context parallelism,
    positions interleave over ``TOTAL_CP_WORLD_SIZE`` ranks in runs of
    ``CP_KV_CACHE_INTERLEAVE_SIZE`` and tokens of other ranks get ``PAD_ID``. Entries
    ``num_tokens..max_num_tokens-1`` get ``PAD_ID``; tokens past the last request are
    left as they are."""
    device = slot_mapping_ptr.device
    starts = query_start_loc_ptr.to(torch.int64)
    num_reqs = starts.shape[0] - 1
    token = torch.arange(num_tokens, device=device)
    req, _ = _segment_of(token, starts[1:])
    inside = (token >= starts[0]) & (token < starts[num_reqs])

    pos = positions_ptr[:num_tokens].to(torch.int64)
    virtual_block_size = KV_CACHE_BLOCK_SIZE * TOTAL_CP_WORLD_SIZE
    virtual_block = pos // virtual_block_size
    virtual_offset = pos - virtual_block * virtual_block_size
    local = (virtual_offset // CP_KV_CACHE_INTERLEAVE_SIZE) % TOTAL_CP_WORLD_SIZE == TOTAL_CP_RANK
    local_offset = (virtual_offset // (TOTAL_CP_WORLD_SIZE * CP_KV_CACHE_INTERLEAVE_SIZE)) * (
        CP_KV_CACHE_INTERLEAVE_SIZE
    ) + virtual_offset % CP_KV_CACHE_INTERLEAVE_SIZE

    read = inside & local
    column = torch.where(read, virtual_block, 0).clamp(0, block_table_ptr.shape[1] - 1)
    block = torch.where(read, block_table_ptr[torch.where(read, req, 0), column].to(torch.int64), 0)
    slots = torch.where(local, block * KV_CACHE_BLOCK_SIZE + local_offset, PAD_ID)

    out = slot_mapping_ptr[:num_tokens]
    out.copy_(torch.where(inside, slots.to(out.dtype), out))
    slot_mapping_ptr[num_tokens:max_num_tokens].fill_(PAD_ID)


def rejection_greedy_sample_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    max_spec_len,
    uniform_probs_ptr,
    synthetic_conditional_rates_ptr,
    SYNTHETIC_MODE,
) -> None:
    """Greedy verification, for the rows where ``is_greedy`` (all rows when it is None):
    a draft is accepted where it equals the target's argmax (in synthetic mode: where its
    uniform draw is below the position's conditional rate and it is not padding, -1);
    each slot up to the first rejection gets the accepted draft or the target's argmax,
    and a row with all its drafts accepted gets its bonus token after them."""
    out = output_token_ids_ptr
    draft_ids = draft_token_ids_ptr
    counts, index, in_range = _draft_slots(cu_num_draft_tokens_ptr, max_spec_len, draft_ids.shape[0])
    draft = draft_ids[index].to(torch.int64)
    target = target_argmax_ptr[index].to(torch.int32).to(torch.int64)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        pos = torch.arange(index.shape[1], device=out.device).clamp(max=max(rates.shape[0] - 1, 0))
        accepted = (uniform_probs_ptr[index] < rates[pos]) & (draft >= 0)
    else:
        accepted = draft == target
    tokens = torch.where(accepted, draft, target)
    if is_greedy_ptr is None:
        rows = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    else:
        rows = is_greedy_ptr[: out.shape[0]].to(torch.bool)
    _write_verified(out, rows, counts, in_range, accepted, tokens, bonus_token_ids_ptr)


def rejection_random_sample_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    bonus_token_ids_ptr,
    recovered_token_ids_ptr,
    uniform_probs_ptr,
    is_greedy_ptr,
    max_spec_len,
    vocab_size,
    synthetic_conditional_rates_ptr,
    NO_DRAFT_PROBS,
    SYNTHETIC_MODE,
) -> None:
    """Speculative-sampling verification, for the rows where not ``is_greedy``: draft ``d``
    at a slot with uniform draw ``u`` is accepted where ``q(d) > 0`` and
    ``p(d) / q(d) >= u`` (``p`` the target's probabilities, ``q`` the draft's, 1 without
    draft probabilities; in synthetic mode ``u`` below the position's conditional rate);
    padding drafts (-1) are rejected. Each slot up to the first rejection gets the accepted
    draft or the slot's recovered token, and a row with all its drafts accepted gets its
    bonus token after them."""
    out = output_token_ids_ptr
    draft_ids = draft_token_ids_ptr
    counts, index, in_range = _draft_slots(cu_num_draft_tokens_ptr, max_spec_len, draft_ids.shape[0])
    draft = draft_ids[index].to(torch.int64)
    uniform = uniform_probs_ptr[index]
    real = draft >= 0
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        pos = torch.arange(index.shape[1], device=out.device).clamp(max=max(rates.shape[0] - 1, 0))
        accepted = real & (uniform < rates[pos])
    else:
        token = draft.clamp(min=0)
        target_prob = target_probs_ptr[index, token]
        if NO_DRAFT_PROBS:
            accepted = real & (target_prob >= uniform)
        else:
            draft_prob = draft_probs_ptr[index, token]
            accepted = real & (draft_prob > 0) & (target_prob / draft_prob >= uniform)
    tokens = torch.where(accepted, draft, recovered_token_ids_ptr[index].to(torch.int64))
    rows = ~is_greedy_ptr[: out.shape[0]].to(torch.bool)
    _write_verified(out, rows, counts, in_range, accepted, tokens, bonus_token_ids_ptr)


def expand_kernel(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS) -> None:
    """``output[t] = input[i]`` for the tokens ``t`` of request ``i`` (the first
    ``MAX_NUM_TOKENS`` of each; request ``i`` ends at ``cu_num_tokens[i]``), with
    ``replace_from`` written as ``replace_to``; any dtype."""
    if input_ptr.shape[0] == 0 or output_ptr.shape[0] == 0:
        return
    ends = cu_num_tokens_ptr.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    token = torch.arange(output_ptr.shape[0], device=output_ptr.device)
    req, inside = _segment_of(token, ends)
    inside &= token - starts[req] < MAX_NUM_TOKENS
    values = torch.where(input_ptr == replace_from, replace_to, input_ptr)
    output_ptr.copy_(torch.where(inside, values[req].to(output_ptr.dtype), output_ptr))


def sample_recovered_tokens_kernel(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    inv_q_ptr,
    vocab_size,
    BLOCK_SIZE,
    NO_DRAFT_PROBS,
    USE_FP64_GUMBEL,
) -> None:
    """The recovered token of every draft token ``t`` of request ``i``: the first argmax
    over the vocabulary of ``max(p - q, 0) * inv_q[i]`` (``p`` the target's probabilities
    at ``t``, ``q`` the draft's; without draft probabilities ``p`` with the draft token
    zeroed), i.e. a draw from the residual distribution with request ``i``'s exponential
    noise ``1 / inv_q[i]``. ``inv_q``'s dtype sets the precision (fp64 for
    ``USE_FP64_GUMBEL``)."""
    out = output_token_ids_ptr
    num_tokens = out.shape[0]
    if num_tokens == 0 or cu_num_draft_tokens_ptr.shape[0] == 0:
        return
    req, inside = _segment_of(torch.arange(num_tokens, device=out.device), cu_num_draft_tokens_ptr)
    target = target_probs_ptr[:num_tokens, :vocab_size]
    if NO_DRAFT_PROBS:
        vocab = torch.arange(vocab_size, device=out.device)
        draft = draft_token_ids_ptr[:num_tokens].to(torch.int64)
        prob = torch.where(vocab == draft[:, None], 0.0, target)
    else:
        prob = (target - draft_probs_ptr[:num_tokens, :vocab_size]).clamp_(min=0.0)
    noise = inv_q_ptr[req, :vocab_size]
    score = prob.mul_(noise) if noise.dtype == prob.dtype else prob * noise
    recovered = score.argmax(dim=1).clamp_(max=vocab_size - 1)
    out.copy_(torch.where(inside, recovered.to(out.dtype), out))


def greedy_sample(logits: Tensor) -> Tensor:
    """vLLM's greedy sampler off its CPU platform: each row's first argmax."""
    return logits.argmax(dim=-1).view(-1)


def apply_top_k_top_p(logits: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """vLLM's PyTorch top-k/top-p mask (logits outside it set to -inf, in place), by
    sorting each row: no host synchronisation, top-k alone included."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=False)


_SAMPLER = "vllm.v1.sample.rejection_sampler."

# vLLM's qualified name of each replaced kernel -> its implementation here.
KERNEL_OVERRIDES = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping_kernel,
    _SAMPLER + "rejection_greedy_sample_kernel": rejection_greedy_sample_kernel,
    _SAMPLER + "rejection_random_sample_kernel": rejection_random_sample_kernel,
    _SAMPLER + "expand_kernel": expand_kernel,
    _SAMPLER + "sample_recovered_tokens_kernel": sample_recovered_tokens_kernel,
    "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p": apply_top_k_top_p,
}
