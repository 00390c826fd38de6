"""DSpark's draft layers over paged caches against the full-sequence reference drafter.

The paged path writes context keys during the target's forward (prefill chunks and
multi-token verify steps) and drafts from them; the reference recomputes the target
features of the whole verified sequence. Base logits, head hidden states and the greedy
Markov drafts must agree (fp32).
"""

from __future__ import annotations

import pytest
import torch
from v41_harness import PagedHarness

from deepinfer_vllm.ops.dspark import confidence, markov_logits
from deepinfer_vllm.reference.dspark import ReferenceDSpark

K = 3


@pytest.fixture(scope="module")
def harness(tiny_checkpoint, single_thread):
    return PagedHarness(
        tiny_checkpoint, speculative_config={"method": "dspark", "num_speculative_tokens": K}
    )


@pytest.fixture(scope="module")
def ref_draft(tiny_reference, tiny_checkpoint):
    return ReferenceDSpark.from_pretrained(tiny_reference, tiny_checkpoint)


def _paged_greedy(harness, hh, base, bonus):
    last = harness.model.mtp[-1]
    embed, head = last.markov_head.embed.weight, last.markov_head.head.weight
    proj = last.confidence_head.proj.weight
    prev = torch.tensor([bonus])
    tokens, confs = [], []
    for i in range(K):
        logits, e = markov_logits(base[i : i + 1], prev, embed, head)
        d = int(torch.argmax(logits[0]))
        tokens.append(d)
        confs.append(float(confidence(proj, hh[i : i + 1], e)[0]))
        prev = torch.tensor([d])
    return tokens, confs


def _check(harness, ref_draft, rid, bonus):
    seq = harness.requests[rid].tokens
    hh, base = harness.draft_block([rid], [bonus], K)
    want = ref_draft.draft_greedy(seq, bonus, K)
    torch.testing.assert_close(base, want.base, rtol=0, atol=1e-5)
    torch.testing.assert_close(hh, want.hh, rtol=0, atol=1e-6)
    tokens, confs = _paged_greedy(harness, hh, base, bonus)
    assert tokens == want.tokens
    assert confs == pytest.approx(want.confidences.tolist(), abs=1e-6)


def test_draft_after_chunked_prefill_and_verify_steps(harness, ref_draft, acceptance_prompts):
    prompt = acceptance_prompts[1]  # 64 tokens, eight windows of the tiny model
    harness.step([("a", prompt[:40])])
    harness.step([("a", prompt[40:])])
    _check(harness, ref_draft, "a", bonus=777)
    # A verify-shaped step: the bonus and three drafts at once; the draft then anchors at
    # the last of them (all accepted).
    harness.step([("a", [777, 10, 20, 30])])
    _check(harness, ref_draft, "a", bonus=4242)


def test_draft_batched_requests_short_and_long(harness, ref_draft, acceptance_prompts):
    short, long = acceptance_prompts[0][:5], acceptance_prompts[2]  # 5 < window 8 <= 200
    harness.step([("s", short), ("l", long)])
    _, base = harness.draft_block(["s", "l"], [11, 12], K)
    for j, (rid, bonus) in enumerate((("s", 11), ("l", 12))):
        want = ref_draft.draft_greedy(harness.requests[rid].tokens, bonus, K)
        torch.testing.assert_close(base[j * K : (j + 1) * K], want.base, rtol=0, atol=1e-5)


def test_rejected_rows_do_not_leak_into_the_next_draft(harness, ref_draft, acceptance_prompts):
    """Verify rows past the accepted token wrote context keys; the next draft must not see them."""
    prompt = acceptance_prompts[0]
    harness.step([("r", prompt)])
    harness.step([("r", [5, 6, 7, 8])])  # bonus + 3 drafts; pretend only "5, 6" were accepted
    req = harness.requests["r"]
    req.tokens = req.tokens[:-2]  # the engine rolls back rejected tokens
    # The draft anchors at "6" (its context window ends there) with the new bonus 99.
    _check(harness, ref_draft, "r", bonus=99)
