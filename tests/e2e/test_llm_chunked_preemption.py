"""Small prefill chunks and a KV budget small enough to force preemption: the reference's tokens.

A preempted request comes back with a prefix hit on its own cached blocks and replays the hit's
last window (vLLM's SWA bounded replay, on by default); the reference reproduces that from the
admissions the worker logged."""

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
        num_gpu_blocks_override=20,  # ~300 tokens of KV for 3 requests needing ~330
        disable_log_stats=False,
    )
    yield engine
    del engine


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_chunked_prefill_with_preemption_matches_reference(
    llm, acceptance_prompts, tiny_greedy, replay_admissions
):
    before = _preemptions(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in acceptance_prompts], params)
    admissions = replay_admissions(llm.collective_rpc("deepinfer_replay_log")[0])
    want = [tiny_greedy(p, 16, admissions=admissions[o.request_id]) for p, o in zip(acceptance_prompts, outs)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert _preemptions(llm) > before, "the KV budget did not force a preemption"
    print({o.request_id: admissions[o.request_id] for o in outs})
    assert sum(len(a) for a in admissions.values()) > len(outs), "no request was admitted twice"
