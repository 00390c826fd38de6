"""DSpark through vllm.LLM is lossless: greedy tokens with drafts equal the target's alone (fp32).

One engine per DSpark setting: k = 1 with adaptive verification off, k = 5 with it on. Several drafts
verified without adaptive verification are the TP=2 server's (``test_dspark_server.py``, k = 5: greedy
tokens equal the reference) and the sampling test's (``test_dspark_sampling.py``, k = 2); a k = 3 fixed
engine here ran the same paths (and k = 3 adaptive, k = 5 fixed before it) at an engine start each in
`make test`'s time, which is at its 20-minute limit. Each engine with chunked prefill (64-token chunks),
prefix caching, and a KV budget small enough to preempt.
The target is ``tiny``'s (the ``tiny-dspark`` preset only adds a 5-token block and a
trained draft), so the reference greedy continuations apply unchanged; after prefix hits and
preemptions, with the replays the worker logged (vLLM's SWA bounded replay, on by default).
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

SETTINGS = {
    "k1": {"num_speculative_tokens": 1},
    "k5-adaptive": {"num_speculative_tokens": 5, "enable_adaptive_verification": True},
}


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _per_position(llm) -> list[float]:
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return list(m.values)
    return []


# One xdist group per engine: `make test`'s two workers start different settings side by side.
ENGINES = [pytest.param(k, marks=pytest.mark.xdist_group(f"dspark-{k}")) for k in sorted(SETTINGS)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_dspark_checkpoint):
    llm = LLM(
        model=tiny_dspark_checkpoint,
        dtype="float32",
        max_model_len=256,
        seed=0,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # the 200-token prompt prefills in 4 chunks
        num_gpu_blocks_override=64,
        disable_log_stats=False,
        speculative_config={"method": "dspark", **SETTINGS[request.param]},
    )
    yield request.param, llm
    del llm


def _ids(prompt):
    return {"prompt_token_ids": prompt}


def test_batched_greedy_with_drafts_equals_the_target(engine, acceptance_prompts, reference_greedy):
    name, llm = engine
    drafts_before = _metric(llm, "vllm:spec_decode_num_drafts")
    outs = llm.generate([_ids(p) for p in acceptance_prompts], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_greedy
    assert _metric(llm, "vllm:spec_decode_num_drafts") > drafts_before, f"{name}: nothing was drafted"
    k = SETTINGS[name]["num_speculative_tokens"]
    assert len(_per_position(llm)) == k


def _admissions(llm, replay_admissions):
    return replay_admissions(llm.collective_rpc("deepinfer_replay_log")[0])


def test_one_at_a_time_and_prefix_hit(engine, acceptance_prompts, tiny_greedy, replay_admissions):
    _, llm = engine
    base = acceptance_prompts[2]
    first = base[:150] + [7, 8, 9]
    second = base[:150] + [11, 12, 13, 14]
    out_first = llm.generate([_ids(first)], GREEDY)[0]
    out_second = llm.generate([_ids(second)], GREEDY)[0]
    assert out_second.num_cached_tokens >= 128, out_second.num_cached_tokens
    admissions = _admissions(llm, replay_admissions)
    assert admissions[out_second.request_id][0] == (out_second.num_cached_tokens, len(second))
    for prompt, out in ((first, out_first), (second, out_second)):
        want = tiny_greedy(prompt, 16, admissions=admissions[out.request_id])
        assert list(out.outputs[0].token_ids) == want


@pytest.fixture(scope="module")
def fitted_prompts(tiny_greedy):
    """Prompts whose continuations the tiny-dspark draft was trained on, with the reference's
    greedy continuations: the draft accepts here, so accepted-token paths run."""
    from deepinfer_vllm.tools.train_dspark import Recipe, recipe_prompts

    recipe = Recipe()
    prompts = recipe_prompts(recipe)[0][:4]
    return prompts, [tiny_greedy(p, recipe.continuation) for p in prompts], recipe.continuation


def test_accepted_drafts_keep_the_target_tokens(engine, fitted_prompts):
    name, llm = engine
    prompts, want, n = fitted_prompts
    accepted_before = _metric(llm, "vllm:spec_decode_num_accepted_tokens")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([_ids(p) for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert _metric(llm, "vllm:spec_decode_num_accepted_tokens") > accepted_before, f"{name}: no draft accepted"


def test_many_requests_preempt_and_stay_exact(engine, acceptance_prompts, tiny_greedy, replay_admissions):
    _, llm = engine
    before = _metric(llm, "vllm:num_preemptions")
    prompts = acceptance_prompts * 3
    outs = llm.generate([_ids(p) for p in prompts], GREEDY)
    admissions = _admissions(llm, replay_admissions)
    want = [tiny_greedy(p, 16, admissions=admissions[o.request_id]) for p, o in zip(prompts, outs)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert _metric(llm, "vllm:num_preemptions") > before, "the KV budget did not force a preemption"


def test_image_request_gets_the_text_only_error_with_dspark_on(engine, acceptance_prompts, reference_greedy):
    from PIL import Image

    _, llm = engine
    image_prompt = {"prompt": "<｜deepseek_image｜>", "multi_modal_data": {"image": Image.new("RGB", (84, 84))}}
    with pytest.raises(ValueError, match="text-only"):
        llm.generate([image_prompt], GREEDY)
    out = llm.generate([_ids(acceptance_prompts[0])], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == reference_greedy[0]
