"""The DSpark proposer's host-side pieces: draft distributions, seeded draft generators, and
the outcome labels it feeds the online acceptance estimator."""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer_vllm.configs.dspark import ADDITIONAL_CONFIG_KEY
from deepinfer_vllm.spec_decode.proposer import DSparkProposer, draft_generator


def _proposer(k=3, adaptive=True) -> DSparkProposer:
    cfg = types.SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: {"num_speculative_tokens": k, "adaptive": adaptive}},
        model_config=types.SimpleNamespace(max_model_len=128),
        parallel_config=types.SimpleNamespace(data_parallel_size=1),
    )
    return DSparkProposer(cfg)


def test_draft_distribution_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    params = [
        types.SimpleNamespace(temperature=0.5, top_k=2, top_p=1.0),
        types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.8),
    ]
    q = DSparkProposer._distribution(logits, params)
    want0 = torch.softmax(torch.tensor([4.0, 2.0]), 0)
    assert q[0].tolist() == pytest.approx([*want0.tolist(), 0.0, 0.0])
    # top-p 0.8 over softmax([0, 0, 3, 1]): token 2 alone has 0.82 of the mass.
    assert q[1].tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0])


def test_draft_generators_depend_on_seed_and_anchor_only():
    a = torch.rand(4, generator=draft_generator(7, 100))
    assert torch.equal(a, torch.rand(4, generator=draft_generator(7, 100)))
    assert not torch.equal(a, torch.rand(4, generator=draft_generator(7, 101)))
    assert not torch.equal(a, torch.rand(4, generator=draft_generator(8, 100)))


def test_online_estimator_labels_accepted_slots_and_the_first_rejected_one():
    p = _proposer()
    seen = []
    p.online = types.SimpleNamespace(observe=lambda f, s, y: seen.append((f, s, y)))
    p._last_features = {"a": [0.1, 0.2, 0.3], "b": [1.0, 2.0], "c": [5.0]}
    # a: 3 verified, 1 accepted (two tokens out); b: 2 verified, all accepted (3 out);
    # c: its draft was not scheduled this step (0 verified).
    p._observe(["a", "b", "c"], [[11, 12], [1, 2, 3], [9]], [3, 2, 0])
    assert seen == [([0.1, 0.2, 1.0, 2.0], [0, 1, 0, 1], [1, 0, 1, 1])]
