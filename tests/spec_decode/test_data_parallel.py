"""DSpark with data parallelism: every rank's draft step makes the same MoE calls.

The stages' MoE is their one collective across data-parallel ranks (tokens go through the
expert group), so a rank that drafts nothing must still run each stage's MoE once per step,
in the same order as a rank that drafts: after a step with nothing to draft, and after each of
vLLM's dummy batches on an idle rank. Here the proposer drives the tiny model in-process (one
rank: the MoE calls are counted, the real collectives run in ``tests/e2e/test_parallel.py``'s
DP=2 server).
"""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model_executor"))
from v41_harness import PagedHarness

from deepinfer_vllm.configs.dspark import ADDITIONAL_CONFIG_KEY
from deepinfer_vllm.model_executor.layers.v41_moe import V41MoE
from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin
from deepinfer_vllm.spec_decode.proposer import DSparkProposer

K = 3
STAGES = ["mtp.0.ffn", "mtp.1.ffn"]  # tiny has two DSpark stages


@pytest.fixture(scope="module")
def harness(tiny_checkpoint, single_thread, acceptance_prompts):
    h = PagedHarness(tiny_checkpoint, speculative_config={"method": "dspark", "num_speculative_tokens": K})
    # A step and a draft outside inference mode first: the runner's dummy draft runs in inference
    # mode (as vLLM's dummy runs), and the process-wide weight workspace it reuses must not be
    # first made there (an inference tensor cannot be written to by later tests outside it).
    h.step([("warm", acceptance_prompts[0][:8])])
    h.draft_block(["warm"], [5], K)
    return h


@pytest.fixture
def moe_calls(harness, monkeypatch):
    """``with moe_calls() as calls``: the MoE layers run inside, as (name, rows)."""
    names = {id(m): n for n, m in harness.model.named_modules()}
    forward = V41MoE.forward
    calls: list[tuple[str, int]] | None = None

    def counted(self, x, input_ids):
        if calls is not None:
            calls.append((names[id(self)], x.shape[0]))
        return forward(self, x, input_ids)

    monkeypatch.setattr(V41MoE, "forward", counted)

    @contextlib.contextmanager
    def record():
        nonlocal calls
        calls = []
        try:
            yield calls
        finally:
            calls = None

    return record


def _proposer(model, dp: int, max_model_len: int = 1024, adaptive: bool = False) -> DSparkProposer:
    cfg = types.SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: {"num_speculative_tokens": K, "adaptive": adaptive}},
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        parallel_config=types.SimpleNamespace(data_parallel_size=dp),
    )
    p = DSparkProposer(cfg)
    p.load_model(model)
    return p


def _runner(harness, req_ids: list[str], num_tokens: list[int]):
    """What the proposer reads of vLLM's runner: the batch, its requests' sampling
    parameters (greedy), the device and dtype."""
    greedy = types.SimpleNamespace(temperature=0.0, seed=None, top_k=0, top_p=1.0)
    return types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=req_ids, num_tokens_no_spec=num_tokens),
        requests={r: types.SimpleNamespace(sampling_params=greedy) for r in req_ids},
        device=harness.device,
        dtype=harness.cfg.model_config.dtype,
        _sync_device=lambda: None,
    )


def test_a_step_with_nothing_to_draft_runs_each_stage_moe_once(harness, moe_calls, acceptance_prompts):
    prompt = acceptance_prompts[0]
    harness.reset()
    harness.step([("a", prompt)])
    meta = harness.last_metadata
    runner = _runner(harness, ["a"], [len(prompt) + 1])  # the bonus token sits after the prompt
    dp2 = _proposer(harness.model, dp=2)
    with moe_calls() as calls:
        drafted, _ = dp2.draft(runner, [[777]], meta, None)
    assert len(drafted[0]) == K
    assert calls == [(name, K) for name in STAGES]  # one draft forward: each stage's MoE once
    # Nothing to draft (a prompt chunk that sampled nothing): each stage's MoE once, on one zero row.
    with moe_calls() as calls:
        assert dp2.draft(runner, [[]], meta, None) == ([[]], None)
    assert calls == [(name, 1) for name in STAGES]
    # A request whose block would pass max_model_len drafts nothing either.
    at_limit = _proposer(harness.model, dp=2, max_model_len=len(prompt) - 1 + K)
    with moe_calls() as calls:
        assert at_limit.draft(runner, [[777]], meta, None) == ([[]], None)
    assert calls == [(name, 1) for name in STAGES]
    # The dummy step writes nothing: the next draft is the same, and equals the one-rank draft.
    dp1 = _proposer(harness.model, dp=1)
    with moe_calls() as calls:
        assert dp2.draft(runner, [[777]], meta, None)[0] == drafted
        assert dp1.draft(runner, [[777]], meta, None)[0] == drafted
        n = len(calls)
        # One rank has no other rank to meet: nothing to draft runs nothing.
        assert dp1.draft(runner, [[]], meta, None) == ([[]], None)
    assert n == 2 * len(STAGES) and len(calls) == n


class _VLLMRunner:
    """The parts of vLLM's runner that ``V41RunnerMixin``'s DSpark hooks call."""

    def __init__(self, harness, drafter):
        self.drafter = drafter
        self.device = harness.device
        self.dtype = harness.cfg.model_config.dtype
        self.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=8, max_num_seqs=2)
        self.dummy_runs: list[int] = []
        self.moe_calls: list = []  # the test's record of MoE calls
        self.eplb_steps: list[int] = []  # MoE calls made before each EPLB step

    def _dummy_run(self, num_tokens: int, skip_eplb: bool = False, is_profile: bool = False, **kwargs):
        self.dummy_runs.append(num_tokens)  # the target's forward, then (unless skipped) EPLB
        if not skip_eplb:
            self.eplb_step(is_dummy=True, is_profile=is_profile)

    def eplb_step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        self.eplb_steps.append(len(self.moe_calls))

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return False  # vLLM's test for the whole batch (some request is near max_model_len)

    def initialize_kv_cache(self, kv_cache_config) -> None:
        pass

    def _sync_device(self) -> None:
        pass


class _Runner(V41RunnerMixin, _VLLMRunner):
    pass


def test_dummy_batches_draft_with_data_parallelism_only(harness, moe_calls):
    for dp, want in ((2, [(name, 1) for name in STAGES]), (1, [])):
        runner = _Runner(harness, _proposer(harness.model, dp=dp))
        with moe_calls() as calls:
            runner.moe_calls = calls
            runner._dummy_run(4, uniform_decode=True)
            runner._dummy_run(4, skip_eplb=True)
        assert runner.dummy_runs == [4, 4]
        assert calls == want * 2, dp
        # One EPLB step, after the dummy draft (a busy rank's EPLB step follows its draft too).
        assert runner.eplb_steps == [len(want)], dp


def test_adaptive_profile_times_target_steps_alone(harness, moe_calls):
    runner = _Runner(harness, _proposer(harness.model, dp=2, adaptive=True))
    with moe_calls() as calls:
        runner.initialize_kv_cache(None)
    # Sizes 1, 2, 4, 8 (max_num_batched_tokens), each once cold and three times timed.
    assert runner.dummy_runs == [n for n in (1, 2, 4, 8) for _ in range(4)]
    assert calls == []  # every data-parallel rank profiles the same target steps, no drafts
    assert [n for n, _ in runner.drafter.verify_costs.table()] == [1, 2, 4, 8]


def test_dspark_decides_per_request_whether_a_block_fits(harness):
    runner = _Runner(harness, _proposer(harness.model, dp=2))
    assert runner._input_fits_in_drafter(object()) is True
    assert runner._input_fits_in_drafter(None) is False
    runner.drafter = None  # other drafters: vLLM's test for the batch
    assert runner._input_fits_in_drafter(object()) is False
