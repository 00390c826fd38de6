"""Shared fixtures: checkpoints the project generates itself, in the released format."""

from __future__ import annotations

import os

import pytest
import torch

# vLLM's CPU build needs a KV cache budget; tests keep it small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ACCEPTANCE_PROMPT_LENS = (17, 64, 200)


@pytest.fixture(scope="module")
def single_thread():
    """Small tensors: one intra-op thread is as fast, and immune to a busy host."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    make_checkpoint(out, preset="tiny", seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_dspark_checkpoint(tmp_path_factory) -> str:
    """``tiny`` (the same target weights) with a 5-token DSpark block and a trained draft."""
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny_dspark")
    make_checkpoint(out, preset="tiny-dspark", seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    from deepinfer_vllm.reference.model import ReferenceV41

    return ReferenceV41.from_pretrained(tiny_checkpoint, dtype=torch.float32, num_threads=1)


@pytest.fixture(scope="session")
def acceptance_prompts() -> list[list[int]]:
    """Token-id prompts of 17, 64 and 200 tokens (longer than the window and many groups)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 120000, (n,), generator=g).tolist() for n in ACCEPTANCE_PROMPT_LENS]


@pytest.fixture(scope="session")
def reference_greedy(tiny_reference, acceptance_prompts) -> list[list[int]]:
    """The reference's greedy 16-token continuations of the acceptance prompts."""
    return [tiny_reference.greedy_generate(p, 16) for p in acceptance_prompts]
