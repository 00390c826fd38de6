"""``patch.generator_rewind``: vLLM's runner rewinds a discarded sample's generator by CUDA's
offset; DeepInfer's runners restore the state from before sampling instead."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer_vllm.patch import generator_rewind


def test_vllms_runner_still_rewinds_by_cudas_offset():
    """vLLM 0.32's bookkeeping rewinds each discarded request's generator by 4 (CUDA's Philox
    step), which a CPU generator refuses. When this fails, vLLM rewinds another way: check the
    patch is still needed."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in source
    assert "gen = self.input_batch.generators.get(int(i))" in source
    assert "gen.set_offset(gen.get_offset() - 4)" in source
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError, match="does not use offset"):
        gen.set_offset(gen.get_offset() - 4)


class NPUGenerator:
    """A device generator as the runner sees it: host-side state (seed, offset), an offset
    that sampling kernels advance by their own amounts (not CUDA's 4)."""

    device = SimpleNamespace(type="npu")

    def __init__(self):
        self.seed, self.offset, self.set_offset_calls = 7, 0, 0

    def get_state(self):
        return torch.tensor([self.seed, self.offset])

    def set_state(self, state):
        self.seed, self.offset = (int(v) for v in state)

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.set_offset_calls += 1
        self.offset = offset


class VllmRunnerStub:
    """vLLM's two steps the mixin wraps: sampling advances each generator; bookkeeping
    rewinds those of discarded samples by CUDA's offset step."""

    def _sample(self, logits, spec_decode_metadata):
        for gen in self.input_batch.generators.values():
            if isinstance(gen, NPUGenerator):
                gen.offset += 12  # what one NPU sampling kernel consumed
            else:
                torch.rand(3, generator=gen)
        return "sampled"

    def _bookkeeping_sync(self):
        for i in range(self.input_batch.num_reqs):
            gen = self.input_batch.generators.get(i)
            if gen is not None and self.discard_request_mask.np[i]:
                gen.set_offset(gen.get_offset() - 4)
        return "kept"


def _rewind_runner(generators, discard):
    from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin

    class Runner(V41RunnerMixin, VllmRunnerStub):
        pass

    r = Runner()
    r.input_batch = SimpleNamespace(num_reqs=len(discard), generators=generators)
    r.discard_request_mask = SimpleNamespace(np=np.array(discard))
    return r


def test_npu_generators_rewind_exactly_after_a_discarded_chunk():
    gen, kept = NPUGenerator(), NPUGenerator()
    r = _rewind_runner({0: gen, 1: kept}, [True, False])
    assert r._sample(None, None) == "sampled" and r._bookkeeping_sync() == "kept"
    assert (gen.offset, gen.set_offset_calls) == (0, 0)  # back where it was; no CUDA rewind
    assert kept.offset == 12  # a sample that is kept stays drawn
    assert r.input_batch.generators == {0: gen, 1: kept}


def test_cpu_generators_draw_the_same_numbers_after_the_rewind():
    gen = torch.Generator().manual_seed(3)
    first = torch.rand(3, generator=torch.Generator().manual_seed(3))
    r = _rewind_runner({0: gen}, [True])
    r._sample(None, None)
    r._bookkeeping_sync()
    assert torch.equal(torch.rand(3, generator=gen), first)


def test_save_and_apply_without_a_runner():
    """The two calls as the runner makes them: states saved before the draw, restored (and
    the generators hidden from vLLM's rewind) around the bookkeeping."""
    gen, kept = NPUGenerator(), NPUGenerator()
    generators = {0: gen, 2: kept}
    saved = generator_rewind.save_discarded(generators, np.array([True, True, False]))
    assert list(saved) == [0]  # request 1 has no generator; request 2 keeps its sample
    gen.offset = kept.offset = 12
    with generator_rewind.apply(generators, saved):
        assert generators == {2: kept} and gen.offset == 0
    assert generators == {0: gen, 2: kept} and (gen.set_offset_calls, kept.offset) == (0, 12)
