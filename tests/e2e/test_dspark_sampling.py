"""Sampling with DSpark emits the target's distribution (temperature 1, a 512-token vocabulary).

Each of ``N`` seeded requests samples three tokens after the same prompt: the first from the
prefill step, the next two through DSpark's drafts and vLLM's rejection sampler (k = 2; the
random draft of this checkpoint is accepted often enough on a small vocabulary to exercise
both outcomes). For every emitted token the randomised probability integral transform
``u = F(t - 1) + U * q(t)`` against the target's exact next-token distribution ``q`` (the
full-sequence reference, fp32) is uniform on [0, 1) and independent across tokens exactly
when the emitted tokens follow the target. A chi-square test on 20 bins at significance 1e-3
is the check: under a correct implementation it fails with probability 1e-3 over the choice
of seeds (the seeds are fixed, so the outcome is deterministic). The same samples scored
against the target at temperature 0.8 must be rejected: the test has power.
"""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams

VOCAB = 512
N = 600
BINS = 20
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_vocab_checkpoint(tmp_path_factory) -> str:
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint
    from deepinfer_vllm.tools.presets import get_preset

    cfg = get_preset("tiny")
    text = cfg["text_config"]
    text["vocab_size"] = VOCAB
    # Small vocabularies put the noise and image tokens at the top (tokenizer_builder).
    text["dspark_noise_token_id"] = VOCAB - 2
    cfg["image_token_id"] = VOCAB - 1
    return str(make_checkpoint(tmp_path_factory.mktemp("v512"), config=cfg, seed=0))


def _chi2_pvalue(u: torch.Tensor) -> float:
    counts = torch.bincount((u * BINS).long().clamp(max=BINS - 1), minlength=BINS).double()
    expected = u.numel() / BINS
    stat = float(((counts - expected) ** 2 / expected).sum())
    # chi-square survival function: Q(df / 2, stat / 2), the regularised upper gamma.
    return float(torch.special.gammaincc(torch.tensor((BINS - 1) / 2.0), torch.tensor(stat / 2.0)))


def _next_token_logits(samples: list[list[int]], prompt: list[int], reference) -> dict[tuple[int, ...], torch.Tensor]:
    """The reference's fp64 next-token logits after every prefix the samples pass through (each
    prefix's own forward, computed once for both temperatures)."""
    logits: dict[tuple[int, ...], torch.Tensor] = {}
    for toks in samples:
        for i in range(len(toks)):
            seq = tuple(prompt) + tuple(toks[:i])
            if seq not in logits:
                logits[seq] = reference.forward(list(seq))[-1].double()
    return logits


def _pit(samples: list[list[int]], prompt: list[int], logits: dict, temperature: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    out = []
    for toks in samples:
        seq = list(prompt)
        for t in toks:
            q = torch.softmax(logits[tuple(seq)] / temperature, dim=-1)
            ranked = torch.sort(-q, stable=True).indices
            rank = int((ranked == t).nonzero()[0, 0])
            below = float(q[ranked[:rank]].sum())
            out.append(below + float(torch.rand((), generator=g, dtype=torch.float64)) * float(q[t]))
            seq.append(t)
    return torch.tensor(out, dtype=torch.float64)


def test_emitted_tokens_follow_the_target_distribution(small_vocab_checkpoint):
    from deepinfer_vllm.reference.model import ReferenceV41

    llm = LLM(
        model=small_vocab_checkpoint,
        dtype="float32",
        max_model_len=128,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "dspark", "num_speculative_tokens": 2},
    )
    prompt = [300, 41, 77, 120, 9, 250]
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params)
    samples = [list(o.outputs[0].token_ids) for o in outs]
    metrics = {m.name: m for m in llm.get_metrics()}
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    del llm
    assert all(len(s) == 3 for s in samples)
    # Both outcomes of the rejection sampler were exercised.
    assert 0 < accepted < drafted, (accepted, drafted)

    reference = ReferenceV41.from_pretrained(small_vocab_checkpoint, dtype=torch.float32, num_threads=1)
    logits = _next_token_logits(samples, prompt, reference)
    p_value = _chi2_pvalue(_pit(samples, prompt, logits, 1.0))
    assert p_value > ALPHA, p_value
    # Power: the same draws against a sharper target are rejected.
    assert _chi2_pvalue(_pit(samples, prompt, logits, 0.8)) < ALPHA
