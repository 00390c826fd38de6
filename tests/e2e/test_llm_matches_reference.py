"""vllm.LLM on CPU with the plugin reproduces the reference, token for token (float32).

One engine for the module: default scheduling (chunked prefill on, prefix caching on, vLLM's
SWA bounded replay on: compact prefill truncation, and a replay of the last window after a
prefix hit, which the reference reproduces from the hits the worker logged).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # collective_rpc with a test function needs pickle (test-only).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = LLM(model=tiny_checkpoint, dtype="float32", max_model_len=512, seed=0, enable_prefix_caching=True)
    yield engine
    del engine
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)


def _ids(prompt):
    return {"prompt_token_ids": prompt}


def _admissions(llm, replay_admissions, out):
    """``(hit, length)`` of each admission of ``out``'s request, from the worker's replay log."""
    return replay_admissions(llm.collective_rpc("deepinfer_replay_log")[0]).get(out.request_id, [])


def test_batched_greedy_matches_reference(llm, acceptance_prompts, reference_greedy):
    outs = llm.generate([_ids(p) for p in acceptance_prompts], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_greedy


def test_one_at_a_time_greedy_matches_reference(llm, acceptance_prompts, tiny_greedy, replay_admissions):
    # After the batch above, the 200-token prompt hits its first 192 tokens and replays
    # 184..191; the shorter ones hit nothing (no whole block before their last token).
    for prompt in acceptance_prompts:
        out = llm.generate([_ids(prompt)], GREEDY)[0]
        admissions = _admissions(llm, replay_admissions, out)
        assert admissions == [(out.num_cached_tokens, len(prompt))]
        assert list(out.outputs[0].token_ids) == tiny_greedy(prompt, 16, admissions=admissions)


def test_prompt_logprobs_match_reference(llm, acceptance_prompts, tiny_reference):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([_ids(p) for p in acceptance_prompts], params)
    worst = 0.0
    for prompt, out in zip(acceptance_prompts, outs):
        ref = torch.log_softmax(tiny_reference.forward(prompt).double(), dim=-1)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for pos in range(1, len(prompt)):
            tok = prompt[pos]
            want = ref[pos - 1, tok].item()
            have = got[pos][tok].logprob
            assert math.isfinite(have)
            worst = max(worst, abs(have - want))
    # Stated tolerance: float32 logits, log-softmax over 129280 entries (the
    # hidden states themselves are bit-identical; see the paged-model tests).
    assert worst < 1e-4, worst


def test_prefix_cache_hit_gives_the_reference_replay_tokens(llm, acceptance_prompts, tiny_greedy, replay_admissions):
    base = acceptance_prompts[2]  # 200 tokens: three 64-token blocks are cacheable
    first = base[:150] + [7, 8, 9]
    second = base[:150] + [11, 12, 13, 14]
    llm.generate([_ids(first)], GREEDY)
    out = llm.generate([_ids(second)], GREEDY)[0]
    assert out.num_cached_tokens >= 128, out.num_cached_tokens
    # The hit's last window (8 tokens) was replayed: the tokens are the reference's with that
    # replay, which differ here from a whole recomputation's.
    admissions = _admissions(llm, replay_admissions, out)
    assert admissions == [(out.num_cached_tokens, len(second))]
    assert list(out.outputs[0].token_ids) == tiny_greedy(second, 16, admissions=admissions)
    assert tiny_greedy(second, 16, admissions=admissions) != tiny_greedy(second, 16)


def test_image_request_gets_a_clear_error_and_the_engine_keeps_serving(llm, acceptance_prompts, reference_greedy):
    from PIL import Image

    image_prompt = {"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"image": Image.new("RGB", (84, 84))}}
    with pytest.raises(ValueError, match="text-only"):
        llm.generate([image_prompt], GREEDY)
    out = llm.generate([_ids(acceptance_prompts[0])], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == reference_greedy[0]


def test_caches_are_packed_block_outermost_without_padding(llm):
    """Records keep their real sizes: vLLM packs the V4.1 pages of a block side by side."""
    def worker_view(worker):
        return worker.vllm_config.cache_config.kv_cache_layout, len(worker.model_runner.kv_cache_config.kv_cache_groups)

    (layout, groups), = llm.collective_rpc(worker_view)
    assert layout == "BLNHC"
    assert groups >= 3
