"""Small prefill chunks and a KV budget small enough to force preemption: same tokens."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    engine = LLM(
        model=tiny_checkpoint,
        dtype="float32",
        max_model_len=256,
        seed=0,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,  # 200-token prompt -> 7 chunks
        num_gpu_blocks_override=24,  # ~320 tokens of KV for 3 requests needing ~330
        disable_log_stats=False,
    )
    yield engine
    del engine


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_chunked_prefill_with_preemption_matches_reference(llm, acceptance_prompts, reference_greedy):
    before = _preemptions(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in acceptance_prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_greedy
    assert _preemptions(llm) > before, "the KV budget did not force a preemption"
