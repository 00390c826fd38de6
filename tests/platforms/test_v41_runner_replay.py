"""The runner's per-request step fields (``V41RunnerMixin``): replay starts taken from vLLM's
scheduler output (new requests carry ``replay_start``; a request resumed after preemption
carries its rewound computed count, which is its replay start), handed to the model only while
a request is inside its replay; prompt-logprob requests marked to keep every prompt row; and
whether a step holds prompt rows at all. vLLM's real scheduler-output classes, a stand-in
runner base."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

from deepinfer_vllm.attention_backends.mla_swa import V41StepMetadata
from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin

W = 8


class _Batch:
    def __init__(self, rows):  # rows: [(req id, computed, prompt)]
        self.req_ids = [r for r, _, _ in rows]
        self.num_reqs = len(rows)
        self.num_computed_tokens_cpu = np.array([c for _, c, _ in rows], dtype=np.int32)
        self.num_prompt_tokens = np.array([p for _, _, p in rows], dtype=np.int32)
        self.num_prompt_tokens_cpu_tensor = torch.from_numpy(self.num_prompt_tokens.copy())


class _Base:
    """The parts of vLLM's V1 runner the mixin calls."""

    def _update_states(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(num_tokens=len(new.prompt_token_ids))

    def _build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        meta = V41StepMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            query_start_loc=None,
            seq_lens=torch.zeros(num_reqs, dtype=torch.int64),
            context_lens=None,
            positions=None,
            token_req=None,
            block_table=None,
            block_size=16,
            max_seq_len=0,
            max_query_len=0,
        )
        return {"layers.0.attn.window_cache": meta}, None


class _Runner(V41RunnerMixin, _Base):
    def __init__(self, replay_window: int):
        spec = SimpleNamespace(prefix_replay_tokens=replay_window)
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
        self.requests = {}
        self.num_prompt_logprobs = {}


def _new(rid: str, prompt_len: int, computed: int, replay_start: int) -> NewRequestData:
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=computed,
        lora_request=None,
        replay_start=replay_start,
    )


def _output(new=(), resumed=(), finished=()):
    cached = CachedRequestData.make_empty()
    for rid, computed in resumed:
        cached.req_ids.append(rid)
        cached.resumed_req_ids.add(rid)
        cached.num_computed_tokens.append(computed)
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, finished_req_ids=set(finished)
    )


def _fields(runner, rows):
    runner.input_batch = _Batch(rows)
    meta = runner._build_attention_metadata(1, len(rows))[0]["layers.0.attn.window_cache"]
    return meta


def test_replay_starts_reach_the_step_only_inside_the_replay():
    runner = _Runner(W)
    # "a" hit 128 of its 154 prompt tokens (replay from 120); "b" hit nothing.
    runner._update_states(_output(new=[_new("a", 154, 120, 120), _new("b", 40, 0, 0)]))
    meta = _fields(runner, [("a", 120, 154), ("b", 0, 40)])
    assert meta.replay_start.tolist() == [120, 0]
    assert meta.prompt_lens.tolist() == [154, 40] and meta.prompt_rows and meta.full_prefill is None
    # A later chunk still inside the replay keeps the start; past the hit there is none.
    assert _fields(runner, [("a", 125, 154), ("b", 16, 40)]).replay_start.tolist() == [120, 0]
    assert _fields(runner, [("a", 128, 154), ("b", 32, 40)]).replay_start is None
    # "a" preempted, resumed with a hit of 64 (its rewound computed count 56 is the replay start).
    runner._update_states(_output(resumed=[("a", 56)]))
    assert _fields(runner, [("a", 56, 154)]).replay_start.tolist() == [56]
    assert runner._v41_replay_log[-1][:2] == ("a", 56)
    assert [entry[:2] for entry in runner._v41_replay_log] == [("a", 120), ("b", 0), ("a", 56)]
    assert runner._v41_replay_log[0][2] == 154  # tokens at admission
    runner._update_states(_output(finished=["a"]))
    assert "a" not in runner._v41_replay_starts


def test_prompt_logprob_requests_keep_every_row_and_decode_steps_have_no_prompt_rows():
    runner = _Runner(W)
    runner._update_states(_output(new=[_new("p", 30, 0, 0), _new("q", 30, 0, 0)]))
    runner.num_prompt_logprobs = {"q": 0}
    meta = _fields(runner, [("p", 0, 30), ("q", 0, 30)])
    assert meta.full_prefill.tolist() == [False, True]
    decode = _fields(runner, [("p", 35, 30), ("q", 31, 30)])
    assert not decode.prompt_rows


def test_without_replaying_groups_nothing_is_recorded():
    """``--no-swa-bounded-replay``: the window caches are cached with the prefix, a hit replays
    nothing, and a resumed request's computed count is its hit (not a replay start)."""
    runner = _Runner(0)
    runner._update_states(_output(new=[_new("a", 154, 128, 0)], resumed=[("b", 64)]))
    assert _fields(runner, [("a", 128, 154)]).replay_start is None
    assert runner._v41_replay_starts is None


def test_replay_needs_deepinfers_runner():
    """Only DeepInfer's workers hand the model replay starts and prompt lengths: under vLLM's own
    runner (the plugin's model on CUDA) the switch stays off and the window caches stay cached."""
    from deepinfer_vllm.attention_backends.cache_layout import model_caches, swa_bounded_replay
    from deepinfer_vllm.configs import V41Arch
    from deepinfer_vllm.tools.presets import get_preset

    def config(worker, on=True):
        return SimpleNamespace(
            cache_config=SimpleNamespace(swa_bounded_replay=on),
            parallel_config=SimpleNamespace(worker_cls=worker),
        )

    assert swa_bounded_replay(config("deepinfer_vllm.platforms.cpu_worker.DeepInferCPUWorker"))
    assert swa_bounded_replay(config("deepinfer_vllm.platforms.ascend.worker.DeepInferNPUWorker"))
    assert not swa_bounded_replay(config("deepinfer_vllm.platforms.cpu_worker.DeepInferCPUWorker", on=False))
    assert not swa_bounded_replay(config("vllm.v1.worker.gpu_worker.Worker"))
    window = next(d for d in model_caches(V41Arch.from_config(get_preset("tiny"))) if d.kind == "window")
    assert window.spec(64, bounded_replay=False).prefix_cacheable
