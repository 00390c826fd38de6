"""The vLLM model class over paged caches equals the full-sequence reference, bit for bit.

In float32 the model accumulates in float64 (``ops.numerics``), so any chunking
or batching of a prompt gives the same logits as one full-sequence forward.
These run the model in-process (``v41_harness``), without the engine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file
from v41_harness import PagedHarness

from deepinfer_vllm.configs.checkpoint import CheckpointFormatError


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120000, (n,), generator=g).tolist()


def _run_chunks(harness, rid, prompt, sizes, prompt_len=None):
    outs, i = [], 0
    for n in sizes:
        lens = None if prompt_len is None else [prompt_len]
        outs.append(harness.step([(rid, prompt[i : i + n])], prompt_lens=lens))
        i += n
    assert i == len(prompt)
    return torch.cat(outs)


@pytest.fixture(scope="module")
def harness(tiny_checkpoint):
    return PagedHarness(tiny_checkpoint, dtype="float32")


def test_whole_prefill_equals_reference(harness, tiny_reference):
    prompt = _prompt(70, 1)
    assert torch.equal(harness.step([("whole", prompt)]), tiny_reference.forward(prompt))


def test_chunked_prefill_and_decode_equal_reference(harness, tiny_reference):
    # Odd chunk boundaries split ratio-2 pairs (compressor ring), single
    # tokens are decode steps, a long chunk spans several blocks.
    prompt = _prompt(90, 2)
    got = _run_chunks(harness, "chunked", prompt, [7, 1, 13, 2, 1, 1, 35, 1, 1, 28])
    assert torch.equal(got, tiny_reference.forward(prompt))


def test_batched_requests_at_different_offsets_equal_reference(harness, tiny_reference):
    a, b = _prompt(60, 3), _prompt(33, 4)
    first = harness.step([("a", a[:25]), ("b", b[:9])])
    second = harness.step([("b", b[9:]), ("a", a[25:])])
    got_a = torch.cat([first[:25], second[24:]])
    got_b = torch.cat([first[25:], second[:24]])
    assert torch.equal(got_a, tiny_reference.forward(a))
    assert torch.equal(got_b, tiny_reference.forward(b))


def test_small_preset_chunked_equals_reference(tmp_path_factory):
    from deepinfer_vllm.reference.model import ReferenceV41
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    path = str(make_checkpoint(tmp_path_factory.mktemp("small"), preset="small", seed=1))
    harness = PagedHarness(path, dtype="float32")
    prompt = _prompt(75, 5)
    got = _run_chunks(harness, "s", prompt, [31, 1, 17, 26])
    ref = ReferenceV41.from_pretrained(path, dtype=torch.float32, num_threads=1)
    assert torch.equal(got, ref.forward(prompt))


def test_prefill_truncation_mask_and_compact_are_bit_identical(tiny_checkpoint, tiny_reference, monkeypatch):
    """DeepInfer's prefill truncation: ``mask`` and ``compact`` agree bit for bit on
    every row they both compute, and both equal the reference in that mode."""
    prompt, keep = _prompt(80, 6), 20
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS", str(keep))
    logits = {}
    for mode in ("off", "mask", "compact"):
        monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", mode)
        harness = PagedHarness(tiny_checkpoint, dtype="float32")
        logits[mode] = _run_chunks(harness, mode, prompt, [33, 30, 17], prompt_len=len(prompt))
        ref = tiny_reference.forward(prompt, truncation_mode=mode, keep_tokens=keep)
        kept = slice(len(prompt) - keep, None)
        assert torch.equal(logits[mode][kept], ref[kept])
    kept = slice(len(prompt) - keep, None)
    assert torch.equal(logits["mask"][kept], logits["compact"][kept])
    # The measured cost of truncation (recorded in the issue note): the last
    # row's logits move, but the approximation stays close to the full prefill.
    diff = (logits["mask"][-1] - logits["off"][-1]).abs().max().item()
    print(
        f"prefill truncation mask vs off, last row, max |dlogit| = {diff:.4f} (keep={keep}, T={len(prompt)})"
    )
    assert 0 < diff < 5


def test_malformed_checkpoint_names_the_tensor(tiny_checkpoint, tmp_path):
    """The loader's own check (the only one for hub ids; local folders are also checked
    when the config is built, see ``tests/e2e/test_loading.py``)."""
    tensors = load_file(f"{tiny_checkpoint}/model.safetensors")
    del tensors["layers.3.attn.indexer.wk.weight"]
    tensors["layers.0.attn.wq_a.scale"] = tensors["layers.0.attn.wq_a.scale"][:1].contiguous()
    fresh = PagedHarness(tiny_checkpoint, dtype="float32")
    with pytest.raises(CheckpointFormatError) as err:
        fresh.model.load_weights(iter(tensors.items()))
    assert "layers.3.attn.indexer.wk.weight" in str(err.value)
    assert "layers.0.attn.wq_a.scale" in str(err.value)


@contextlib.contextmanager
def _threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def test_bf16_whole_prefill_equals_reference(tiny_checkpoint):
    """bf16 (the default dtype): the same rows in one call give the reference's bits when both
    run at the same thread count; this also guards against parameters built under vLLM's bf16
    default dtype.

    The condition is the thread count: bf16's fp32 islands go through MKL's sgemm, whose
    summation order depends on the number of threads on Intel hosts (on an Intel Xeon with
    AMX and AVX-512, 2026-12: 2 threads moved rows 11 and 35-47 of 48 by up to 1.6 in a logit,
    16 threads row 11 by 5e-4, 1 thread gave the reference's bits, with oneDNN on or off; on
    AMD hosts (AVX2) every thread count gave them). The reference runs with one thread, so the
    model does here too. Across thread counts the agreement is stated below."""
    from deepinfer_vllm.reference.model import ReferenceV41

    harness = PagedHarness(tiny_checkpoint, dtype="bfloat16")
    ref = ReferenceV41.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16, num_threads=1)
    prompt = _prompt(48, 7)
    want = ref.forward(prompt)
    with _threads(1):
        assert torch.equal(harness.step([("bf16", prompt)]), want)
    # At two threads (this project's hosts have two cores), rows may leave the reference's bits
    # behind an FP8/FP4 bin flip (14 of 48 rows on the Xeon); the argmax of most rows holds
    # (1.000 measured on the AMD host; not measured on the Xeon).
    with _threads(2):
        other = harness.step([("bf16-2", prompt)])
    agree = (other.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"bf16, 2 threads vs the 1-thread reference: argmax agreement {agree:.3f}")
    assert agree >= 0.75


def test_bf16_chunked_prefill_agrees_with_whole_prefill(tiny_checkpoint):
    """A bf16 model still computes some steps in fp32 (norm statistics, softmax, the compressor's
    projections, GEMM accumulation), and those sums round differently for different row counts;
    behind FP8/FP4 caches that can flip a bin. Stated as agreement, not equality."""
    harness = PagedHarness(tiny_checkpoint, dtype="bfloat16")
    agree, rows, worst_cos = 0, 0, 1.0
    for seed in range(4):
        prompt = _prompt(90, 100 + seed)
        whole = harness.step([(f"whole{seed}", prompt)])
        chunked = _run_chunks(harness, f"chunked{seed}", prompt, [7, 1, 13, 2, 1, 1, 35, 1, 1, 28])
        agree += int((whole.argmax(-1) == chunked.argmax(-1)).sum())
        rows += len(prompt)
        worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(whole, chunked, dim=-1).min().item())
    # Measured on the tiny preset (seed 0): 357/360 argmax agreement; one row's
    # logits flipped a bin and sit at cosine 0.874, all others above 0.9999.
    print(f"bf16 chunked vs whole: argmax agreement {agree}/{rows}, min row cosine {worst_cos:.5f}")
    assert agree / rows >= 0.95
    assert worst_cos > 0.8


def test_profiling_run_without_caches_computes_real_activations(harness):
    """vLLM's profiling and data-parallel dummy runs have no attention metadata: the
    whole model still runs (projections, MoE, Engram, head), each token alone."""
    from vllm.forward_context import set_forward_context

    ids = torch.tensor(_prompt(40, 9))
    positions = torch.arange(40) * 7  # any positions the engine may leave in its buffers
    with set_forward_context(None, harness.cfg):
        batch = harness.model(ids, positions)
        alone = torch.cat([harness.model(ids[i : i + 1], positions[i : i + 1]) for i in (0, 17, 39)])
    assert torch.isfinite(batch).all() and (batch.abs().sum(-1) > 0).all()
    # Rows do not see each other: a row computed alone is the batch's row.
    torch.testing.assert_close(alone, batch[[0, 17, 39]], rtol=1e-5, atol=1e-5)
    # The logits of a dummy step are the head's output, not zeros.
    assert torch.isfinite(harness.model.compute_logits(batch)).all()


def test_gemms_sharing_an_input_declare_it(harness, monkeypatch):
    """The layers declare the GEMM inputs their FP8 projections share (``ops.shared_input``), so a
    kernel's preparation of an input (the Gluon GEMMs' rewrite of ``x``) is made once: in each layer
    ``wkv`` reuses ``wq_a``'s, the indexer's ``wq_b`` the query's ``wq_b``'s, the shared expert's ``w1``
    and ``w3`` the routed experts' (whose gate/up GEMM multiplies the same ``x``); no other FP8 GEMM reuses
    one. A probe form stands in for the kernel's (on the CPU the reference runs, which prepares nothing);
    the routed experts are probed as they are entered."""
    from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts
    from deepinfer_vllm.model_executor.quantization import V41Fp8LinearMethod
    from deepinfer_vllm.ops.shared_input import input_form

    calls: list[tuple[str, bool]] = []
    made: list[int] = []
    apply = V41Fp8LinearMethod.apply

    def make(t):  # one maker: forms are recognised by name and maker
        made.append(1)
        return t.clone()

    def probed(self, layer, x, bias=None, out_dtype=None):
        before = len(made)
        input_form(x.reshape(-1, x.shape[-1]), "probe", make)
        calls.append((layer.prefix, len(made) == before))
        return apply(self, layer, x, bias, out_dtype)

    def probed_experts(self, x, *args):
        before = len(made)
        input_form(x.reshape(-1, x.shape[-1]), "probe", make)
        calls.append((self.prefix, len(made) == before))
        return experts_forward(self, x, *args)

    experts_forward = RoutedExperts.forward
    monkeypatch.setattr(V41Fp8LinearMethod, "apply", probed)
    monkeypatch.setattr(RoutedExperts, "forward", probed_experts)
    for name, module in harness.model.named_modules():
        if isinstance(module, RoutedExperts):
            module.prefix = name.removeprefix("model.")
    harness.step([("shared-input", _prompt(5, 11))])
    want_hits, want_makes = set(), set()
    for i, block in enumerate(harness.model.layers):
        p = f"layers.{i}"
        want_makes |= {f"{p}.attn.wq_a", f"{p}.attn.wq_b", f"{p}.attn.wo_b", f"{p}.ffn.experts"}
        want_makes.add(f"{p}.ffn.shared_experts.w2")
        want_hits |= {f"{p}.attn.wkv", f"{p}.ffn.shared_experts.w1", f"{p}.ffn.shared_experts.w3"}
        if block.attn.role.ratio > 0 and block.attn.role.is_index_source:
            want_hits.add(f"{p}.attn.indexer.wq_b")
    hits = {prefix for prefix, hit in calls if hit}
    assert hits == want_hits
    assert {prefix for prefix, hit in calls if not hit} >= want_makes
