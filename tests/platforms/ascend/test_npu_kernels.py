"""The Ascend platform's PyTorch kernels (``platforms/ascend/kernels.py``) against independent references.

The references are vLLM's C++ implementations of the same Triton kernels (its
CPU build, ``vllm.utils.cpu_triton_utils``), and for what those do not cover
(context parallelism, synthetic acceptance, float values in ``expand_kernel``,
whose C++ version drops them) a per-request loop written from the Triton
source. Inputs are random, with the edge cases forced in: padding slots and
``num_tokens < max_num_tokens``, requests without drafts, drafts rejected at
the first position or all accepted, padded draft ids, zero draft
probabilities, greedy and sampled rows in one batch, and vLLM's whole
``rejection_sample`` with seeded and unseeded requests. Then the platform's
registration (every kernel, forwarded by name) and its communicator over gloo.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from deepinfer_vllm.platforms.ascend import kernels as npu_kernels
from deepinfer_vllm.platforms.ascend.platform import HOST_METHODS, DeepInferAscendPlatform

PAD = -1


@pytest.fixture(scope="module")
def cpp():
    """vLLM's C++ fallbacks of its Triton kernels (CPU build), loaded into ``torch.ops._C``."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    if not hasattr(torch.ops._C, "rejection_random_sample_kernel_impl"):
        pytest.skip("vLLM's CPU kernels are not installed")
    from vllm.utils import cpu_triton_utils

    return cpu_triton_utils


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _counts(g, batch: int, max_spec_len: int, zero_rows=(), full_rows=()) -> list[int]:
    counts = torch.randint(0, max_spec_len + 1, (batch,), generator=g).tolist()
    for i in zero_rows:
        counts[i] = 0
    for i in full_rows:
        counts[i] = max_spec_len
    return counts


def _cu(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# ------------------------------------------------------------------ slot mapping
def _slot_mapping_loop(starts, positions, block_table, slot_mapping, block_size, world, rank, interleave):
    """Per request and token, as ``ComputeSlotMappingKernel.kernel`` (without the padding)."""
    out = slot_mapping.clone()
    for r in range(len(starts) - 1):
        for t in range(int(starts[r]), int(starts[r + 1])):
            pos = int(positions[t])
            vblock, voff = divmod(pos, block_size * world)
            if (voff // interleave) % world != rank:
                out[t] = PAD
                continue
            local = (voff // (world * interleave)) * interleave + voff % interleave
            out[t] = int(block_table[r, vblock]) * block_size + local
    return out


def _slot_mapping_inputs(seed: int, block_size: int, stride: int = 16):
    g = _generator(seed)
    num_reqs = int(torch.randint(1, 6, (1,), generator=g))
    lens = torch.randint(1, 40, (num_reqs,), generator=g)
    computed = torch.randint(0, block_size * (stride // 2), (num_reqs,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    positions = torch.cat([c + torch.arange(n) for c, n in zip(computed.tolist(), lens.tolist())])
    max_reqs = num_reqs + 2
    block_table = torch.randint(0, 1000, (max_reqs, stride), generator=g, dtype=torch.int32)
    max_num_tokens = int(positions.shape[0]) + 17
    return starts, positions, block_table, max_num_tokens


@pytest.mark.parametrize("seed", range(6))
def test_slot_mapping_matches_vllm_cpu_kernel(cpp, seed):
    block_size = (16, 64)[seed % 2]
    starts, positions, block_table, max_num_tokens = _slot_mapping_inputs(seed, block_size)
    num_tokens = positions.shape[0]
    ours = torch.full((max_num_tokens + 5,), 777, dtype=torch.int64)
    theirs = ours.clone()
    npu_kernels.compute_slot_mapping_kernel(
        num_tokens, max_num_tokens, starts, positions, block_table, block_table.stride(0), ours,
        block_size, 1, 0, 1, PAD, 1024,
    )
    cpp._compute_slot_mapping_kernel_impl(
        num_tokens, max_num_tokens, starts, positions, block_table, block_table.stride(0), theirs, block_size
    )
    assert torch.equal(ours[:num_tokens], theirs[:num_tokens])
    assert (ours[num_tokens:max_num_tokens] == PAD).all()  # padding slots
    assert (ours[max_num_tokens:] == 777).all()  # past the buffer vLLM hands over: untouched


@pytest.mark.parametrize("world,rank,interleave", [(2, 0, 1), (2, 1, 1), (4, 3, 4), (2, 1, 64)])
def test_slot_mapping_context_parallel(world, rank, interleave):
    block_size = 16
    seed = world * 10 + rank
    starts, positions, block_table, max_num_tokens = _slot_mapping_inputs(seed, block_size, stride=64)
    num_tokens = positions.shape[0]
    # The last request's tokens are left out of query_start_loc: they keep their value.
    cut = starts[:-1]
    ours = torch.full((max_num_tokens,), 777, dtype=torch.int64)
    npu_kernels.compute_slot_mapping_kernel(
        num_tokens, max_num_tokens, cut, positions, block_table, 64, ours,
        block_size, world, rank, interleave, PAD, 1024,
    )
    want = _slot_mapping_loop(cut, positions, block_table, torch.full((num_tokens,), 777), block_size, world,
                              rank, interleave)
    assert torch.equal(ours[:num_tokens], want)
    assert (ours[num_tokens:] == PAD).all()


# ------------------------------------------------------------------ verification
def _verify_loop(output, counts, accepted, tokens, bonus, rows):
    """Per request, as the Triton verification kernels: slots up to the first rejection,
    then the bonus token when nothing was rejected."""
    out = output.clone()
    start = 0
    for i, n in enumerate(counts):
        if rows[i]:
            rejected = False
            for p in range(n):
                if rejected:
                    break
                out[i, p] = tokens[start + p]
                rejected = not accepted[start + p]
            if not rejected:
                out[i, n] = bonus[i]
        start += n
    return out


def _greedy_inputs(seed: int, batch: int = 7, max_spec_len: int = 4, vocab: int = 50):
    g = _generator(seed)
    # Row 0: no drafts; row 1: rejected at the first draft; row 2: all accepted.
    counts = _counts(g, batch, max_spec_len, zero_rows=(0,), full_rows=(1, 2))
    n = sum(counts)
    target = torch.randint(0, vocab, (n,), generator=g)
    draft = torch.where(torch.rand(n, generator=g) < 0.6, target, (target + 1) % vocab).to(torch.int32)
    first1 = counts[0]
    draft[first1] = (target[first1] + 1) % vocab
    first2 = first1 + counts[1]
    draft[first2 : first2 + counts[2]] = target[first2 : first2 + counts[2]].to(torch.int32)
    bonus = torch.randint(0, vocab, (batch, 1), generator=g)
    is_greedy = torch.rand(batch, generator=g) < 0.7
    is_greedy[:3] = True
    return counts, draft, target, bonus, is_greedy


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_verification_matches_vllm_cpu_kernel(cpp, seed, all_greedy):
    counts, draft, target, bonus, is_greedy = _greedy_inputs(seed)
    mask = None if all_greedy else is_greedy
    cu, max_spec_len = _cu(counts), 4
    ours = torch.full((len(counts), max_spec_len + 1), PAD, dtype=torch.int32)
    theirs = ours.clone()
    args = (cu, draft, target, bonus, mask, max_spec_len, None, None, False)
    npu_kernels.rejection_greedy_sample_kernel(ours, *args)
    cpp._rejection_greedy_sample_kernel_impl(theirs, *args)
    assert torch.equal(ours, theirs)
    assert ours[1, 1].item() == PAD and ours[2, max_spec_len].item() == bonus[2, 0].item()


def test_verification_without_drafts(cpp):
    """A step whose requests have no draft at all: every row gets its bonus token first."""
    bonus, is_greedy = torch.tensor([[5], [6], [7]]), torch.tensor([True, False, True])
    cu, empty, probs = torch.zeros(3, dtype=torch.int32), torch.empty(0, dtype=torch.int32), torch.empty(0, 8)
    ours = torch.full((3, 4), PAD, dtype=torch.int32)
    theirs = ours.clone()
    greedy = (cu, empty, empty.long(), bonus, is_greedy, 3, None, None, False)
    npu_kernels.rejection_greedy_sample_kernel(ours, *greedy)
    cpp._rejection_greedy_sample_kernel_impl(theirs, *greedy)
    uniform = torch.empty(0, dtype=torch.float64)
    sampled = (cu, empty, probs, probs, bonus, empty, uniform, is_greedy, 3, 8, None, False, False)
    npu_kernels.rejection_random_sample_kernel(ours, *sampled)
    cpp._rejection_random_sample_kernel_impl(theirs, *sampled)
    assert torch.equal(ours, theirs) and ours[:, 0].tolist() == [5, 6, 7]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_verification_synthetic(seed):
    counts, draft, target, bonus, is_greedy = _greedy_inputs(seed)
    g = _generator(100 + seed)
    draft[torch.rand(draft.shape[0], generator=g) < 0.1] = -1  # padded drafts are rejected
    uniform = torch.rand(draft.shape[0], generator=g, dtype=torch.float64)
    rates = torch.tensor([0.9, 0.7, 0.5, 0.3])
    ours = torch.full((len(counts), 5), PAD, dtype=torch.int32)
    npu_kernels.rejection_greedy_sample_kernel(ours, _cu(counts), draft, target, bonus, is_greedy, 4, uniform,
                                               rates, True)
    pos = torch.cat([torch.arange(n) for n in counts])
    accepted = ((uniform < rates[pos]) & (draft >= 0)).tolist()
    tokens = torch.where(torch.tensor(accepted), draft.long(), target).tolist()
    rows = is_greedy.tolist()
    want = _verify_loop(torch.full_like(ours, PAD), counts, accepted, tokens, bonus[:, 0].tolist(), rows)
    assert torch.equal(ours, want)


def _random_inputs(seed: int, batch: int = 8, max_spec_len: int = 4, vocab: int = 32, no_draft_probs=False,
                   padded=False):
    g = _generator(seed)
    counts = _counts(g, batch, max_spec_len, zero_rows=(0,), full_rows=(1, 2))
    n = sum(counts)
    target_probs = torch.softmax(torch.randn(n, vocab, generator=g) * 2, dim=-1)
    draft_probs = None if no_draft_probs else torch.softmax(torch.randn(n, vocab, generator=g) * 2, dim=-1)
    draft = torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32)
    # float32 draws in float64: vLLM's C++ kernel compares in float32.
    uniform = torch.rand(n, generator=g).to(torch.float64)
    recovered = torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32)
    s1 = counts[0]
    uniform[s1] = 1.0  # row 1: rejected at the first draft (ratio < 1 for every draft but exact ties)
    if draft_probs is not None:
        target_probs[s1, draft[s1]] = 0.5 * draft_probs[s1, draft[s1]]
    s2 = s1 + counts[1]
    uniform[s2 : s2 + counts[2]] = 0.0  # row 2: all accepted
    if draft_probs is not None and n > s2 + counts[2] + 1:
        draft_probs[s2 + counts[2], draft[s2 + counts[2]]] = 0.0  # a zero draft probability: rejected
    if padded:
        draft[torch.rand(n, generator=g) < 0.15] = -1  # padded drafts: rejected
    bonus = torch.randint(0, vocab, (batch, 1), generator=g)
    is_greedy = torch.rand(batch, generator=g) < 0.3
    is_greedy[1:3] = False
    return counts, draft, draft_probs, target_probs, bonus, recovered, uniform, is_greedy


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("no_draft_probs", [False, True])
def test_random_verification_matches_vllm_cpu_kernel(cpp, seed, no_draft_probs):
    counts, draft, draft_probs, target_probs, bonus, recovered, uniform, is_greedy = _random_inputs(
        seed, no_draft_probs=no_draft_probs
    )
    cu, vocab = _cu(counts), target_probs.shape[1]
    ours = torch.full((len(counts), 5), PAD, dtype=torch.int32)
    theirs = ours.clone()
    args = (cu, draft, draft_probs, target_probs, bonus, recovered, uniform, is_greedy, 4, vocab, None,
            no_draft_probs, False)
    npu_kernels.rejection_random_sample_kernel(ours, *args)
    cpp._rejection_random_sample_kernel_impl(theirs, *args)
    assert torch.equal(ours, theirs)
    assert ours[1, 0].item() == recovered[counts[0]].item() and ours[1, 1].item() == PAD
    assert ours[2, 4].item() == bonus[2, 0].item()


@pytest.mark.parametrize("synthetic", [False, True])
def test_random_verification_with_padded_drafts(synthetic):
    """Padded draft ids (-1) are rejected (vLLM's C++ kernel accepts them: only the loop here)."""
    inputs = _random_inputs(3, padded=True)
    counts, draft, draft_probs, target_probs, bonus, recovered, uniform, is_greedy = inputs
    rates = torch.tensor([0.8, 0.6, 0.4, 0.2]) if synthetic else None
    ours = torch.full((len(counts), 5), PAD, dtype=torch.int32)
    npu_kernels.rejection_random_sample_kernel(
        ours, _cu(counts), draft, draft_probs, target_probs, bonus, recovered, uniform, is_greedy, 4,
        target_probs.shape[1], rates, False, synthetic,
    )
    pos = torch.cat([torch.arange(n) for n in counts]).tolist()
    accepted = []
    for t, d in enumerate(draft.tolist()):  # per draft token, as the Triton kernel
        if d < 0:
            accepted.append(False)
        elif synthetic:
            accepted.append(uniform[t].item() < rates[pos[t]].item())
        else:
            q = draft_probs[t, d]
            accepted.append(q.item() > 0 and (target_probs[t, d] / q).item() >= uniform[t].item())
    assert not all(accepted) and (draft < 0).any()
    tokens = torch.where(torch.tensor(accepted), draft, recovered).tolist()
    rows = (~is_greedy).tolist()
    want = _verify_loop(torch.full_like(ours, PAD), counts, accepted, tokens, bonus[:, 0].tolist(), rows)
    assert torch.equal(ours, want)


# ------------------------------------------------------------------ expand, recovered tokens
@pytest.mark.parametrize("seed", range(4))
def test_expand_matches_vllm_cpu_kernel_and_keeps_floats(cpp, seed):
    g = _generator(seed)
    counts = _counts(g, 6, 5, zero_rows=(2,))
    cu, n = _cu(counts), sum(counts)
    ints = torch.randint(0, 4, (6,), generator=g)
    ours, theirs = torch.full((n,), 99), torch.full((n,), 99)
    npu_kernels.expand_kernel(ours, ints, cu, 0, 7, 128)
    cpp._expand_kernel_impl(theirs, ints, cu, 0, 7)
    assert torch.equal(ours, theirs)
    # Floats (temperatures, top-p): vLLM's C++ version never writes them back.
    temps = torch.rand(6, generator=g)
    temps[1] = 0.0
    out = torch.full((n,), float("nan"))
    npu_kernels.expand_kernel(out, temps, cu, 0, 1, 128)
    want = torch.repeat_interleave(torch.where(temps == 0, 1.0, temps), torch.tensor(counts))
    assert torch.equal(out, want)
    capped = torch.full((n,), -5)
    npu_kernels.expand_kernel(capped, ints, cu, 0, 7, 2)  # at most MAX_NUM_TOKENS per request
    kept = torch.cat([torch.arange(c) < 2 for c in counts])
    assert torch.equal(capped[kept], theirs[kept]) and (capped[~kept] == -5).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("no_draft_probs", [False, True])
@pytest.mark.parametrize("fp64", [False, True])
def test_recovered_tokens_match_vllm_cpu_kernel(cpp, seed, no_draft_probs, fp64):
    inputs = _random_inputs(seed, vocab=300, no_draft_probs=no_draft_probs)
    counts, draft, draft_probs, target_probs = inputs[:4]
    dtype = torch.float64 if fp64 else torch.float32
    q = torch.empty(len(counts), 300, dtype=dtype).exponential_(generator=_generator(50 + seed))
    inv_q = q.reciprocal()
    ours = torch.full((draft.shape[0],), PAD, dtype=torch.int32)
    theirs = ours.clone()
    args = (_cu(counts), draft, draft_probs, target_probs, inv_q, 300, 8192, no_draft_probs, fp64)
    npu_kernels.sample_recovered_tokens_kernel(ours, *args)
    # vLLM's C++ kernel reads inv_q in float32: the same draw unless two scores tie there.
    cpp._sample_recovered_tokens_kernel_impl(theirs, *args)
    assert torch.equal(ours, theirs)
    if no_draft_probs:
        assert (ours != draft).all()  # the rejected draft itself is never recovered


# ------------------------------------------------------------------ vLLM's rejection sampler
_SAMPLER_KERNELS = {
    "_rejection_greedy_sample": ("rejection_greedy_sample_kernel", "_rejection_greedy_sample_kernel_impl"),
    "_rejection_random_sample": ("rejection_random_sample_kernel", "_rejection_random_sample_kernel_impl"),
    "_sample_recovered_tokens": ("sample_recovered_tokens_kernel", "_sample_recovered_tokens_kernel_impl"),
}


def _bind(monkeypatch, impls: dict) -> None:
    """Point vLLM's rejection-sampler launchers at ``impls`` (undone after the test)."""
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.sample import rejection_sampler

    for owner_name, impl in impls.items():
        owner = getattr(rejection_sampler, owner_name)
        monkeypatch.setattr(owner, "kernel", KernelOverride(owner.kernel, impl))
        monkeypatch.delitem(vars(owner), "_kernel_arg_names", raising=False)


def _rejection_sample(seeds: dict[int, int], draft, counts, draft_probs, logits, bonus, temperature):
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample

    torch.manual_seed(1234)  # the unseeded requests' draws
    metadata = SamplingMetadata(
        temperature=temperature, all_greedy=False, all_random=False, top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(s) for i, s in seeds.items()}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=None, presence_penalties=None,
        repetition_penalties=None, output_token_ids=[[] for _ in counts], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=None,
    )
    return rejection_sample(draft, counts, max(counts), _cu(counts), draft_probs, logits, bonus, metadata)


@pytest.mark.parametrize("seed", range(3))
def test_vllm_rejection_sample_with_seeded_and_unseeded_requests(cpp, monkeypatch, seed):
    """vLLM's whole ``rejection_sample`` (uniform draws and the recovered tokens' noise from
    the seeded requests' generators, the rest from the global one; greedy and sampled rows
    in one batch): the same tokens on these kernels as on vLLM's C++ ones."""
    counts, draft, draft_probs, target_probs, bonus, *_ = _random_inputs(seed, batch=6, vocab=64)
    logits = torch.log(target_probs)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 0.9, 1.3])
    seeds = {1: 11, 4: 44}
    _bind(monkeypatch, {owner: getattr(npu_kernels, name) for owner, (name, _) in _SAMPLER_KERNELS.items()})
    ours = _rejection_sample(seeds, draft, counts, draft_probs, logits.clone(), bonus, temperature)
    _bind(monkeypatch, {owner: getattr(cpp, name) for owner, (_, name) in _SAMPLER_KERNELS.items()})
    theirs = _rejection_sample(seeds, draft, counts, draft_probs, logits.clone(), bonus, temperature)
    assert torch.equal(ours, theirs)
    again = {1: 11, 4: 45}  # another seed for request 4: only its row may change
    _bind(monkeypatch, {owner: getattr(npu_kernels, name) for owner, (name, _) in _SAMPLER_KERNELS.items()})
    other = _rejection_sample(again, draft, counts, draft_probs, logits.clone(), bonus, temperature)
    assert torch.equal(other[[0, 1, 2, 3, 5]], ours[[0, 1, 2, 3, 5]])


# ------------------------------------------------------------------ sampler entry points
@pytest.mark.parametrize("case", ["k", "p", "kp"])
def test_top_k_top_p_is_vllms_pytorch_mask(case):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = _generator(7)
    logits = torch.randn(5, 200, generator=g)
    k = torch.tensor([1, 5, 200, 17, 3]) if "k" in case else None
    p = torch.tensor([0.5, 0.9, 1.0, 0.2, 0.99]) if "p" in case else None
    ours = npu_kernels.apply_top_k_top_p(logits.clone(), k, p)
    # vLLM's CPU path (top-k alone by torch.topk, after a host synchronisation): the same mask.
    theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
    assert torch.equal(ours, theirs)
    if k is not None:
        assert ((ours > float("-inf")).sum(1) >= torch.minimum(k, torch.tensor(1))).all()


def test_greedy_sample_is_the_first_argmax(cpp):
    logits = torch.randn(6, 100, generator=_generator(3))
    logits[2, 10] = logits[2, 40] = logits[2].max() + 1  # a tie: the lower id
    assert torch.equal(npu_kernels.greedy_sample(logits), torch.ops._C.greedy_argmax(logits).view(-1))
    assert npu_kernels.greedy_sample(logits)[2].item() == 10


# ------------------------------------------------------------------ the platform
def test_platform_registers_every_kernel_forwarded_by_name(monkeypatch):
    from vllm.triton_utils import dispatcher

    registered = {}
    monkeypatch.setattr(dispatcher, "register_kernels", registered.update)
    DeepInferAscendPlatform.register_triton_kernel_overrides()
    assert registered == npu_kernels.KERNEL_OVERRIDES
    assert len(registered) == 6
    for name, impl in registered.items():
        host, attr = dispatcher._resolve_kernel(name)
        original = getattr(host, attr)
        # The dispatcher forwards a launch by name exactly when the parameters match.
        assert dispatcher._kernel_arg_names(original) == tuple(inspect.signature(impl).parameters), name


def test_only_host_facts_are_delegated_when_simulated():
    """The simulated NPU takes the CPU platform's answer only for host-memory pinning;
    kernels, Triton overrides, communicator and the rest are the real platform's (the engine
    tests in test_ascend_simulated_llm.py run them: vLLM's defaults for the last two stop V4.1)."""
    assert HOST_METHODS == ("is_pin_memory_available",)
    for name in ("register_triton_kernel_overrides", "get_device_communicator_cls", "import_kernels",
                 "supported_dtypes", "get_current_memory_usage", "update_block_size_for_backend",
                 "check_runner_kv_caches_multi_layer"):
        assert name in vars(DeepInferAscendPlatform), name
    assert DeepInferAscendPlatform.get_device_communicator_cls().endswith(".DeviceCommunicatorBase")
    # vLLM's torch.compile'd sampler helpers: dynamo, never inductor.
    assert DeepInferAscendPlatform.simple_compile_backend == "eager"


COLLECTIVES = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, port, qualname):
        from vllm.utils.import_utils import resolve_obj_by_qualname

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        comm = resolve_obj_by_qualname(qualname)(
            cpu_group=dist.new_group([0, 1], backend="gloo"), device=torch.device("cpu"),
            device_group=dist.new_group([0, 1], backend="gloo"), unique_name="tp:0",
        )
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.arange(6, dtype=dtype).reshape(2, 3) + rank
            assert torch.equal(comm.all_reduce(x.clone()), 2 * torch.arange(6, dtype=dtype).reshape(2, 3) + 1)
        x = torch.full((2, 3), float(rank))
        assert torch.equal(comm.all_gather(x, dim=-1), torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], -1))
        mine = comm.reduce_scatter(torch.arange(4.0) + rank, dim=0)
        assert torch.equal(mine, 2 * torch.arange(4.0)[2 * rank : 2 * rank + 2] + 1)
        gathered = comm.gather(x, dst=0, dim=0)
        assert (gathered is None) == (rank == 1)
        assert torch.equal(comm.broadcast(torch.full((3,), float(rank)), src=1), torch.ones(3))
        if rank == 0:
            comm.send(torch.arange(5.0), dst=1)
        else:
            assert torch.equal(comm.recv(torch.Size([5]), torch.float32, src=0), torch.arange(5.0))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
        print("COLLECTIVES OK")
    """
)


def test_communicator_collectives_over_gloo(tmp_path):
    """The platform's communicator runs vLLM's collectives over gloo, the simulated NPU's backend
    (on the NPU the same calls go to HCCL through torch_npu's process groups)."""
    from vllm.utils.network_utils import get_open_port

    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    qualname = DeepInferAscendPlatform.get_device_communicator_cls()
    proc = subprocess.run([sys.executable, str(script), str(get_open_port()), qualname],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "COLLECTIVES OK" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
