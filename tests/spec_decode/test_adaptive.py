"""Confidence-scheduled verification: budget choice, cost table, online acceptance estimator."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_vllm.spec_decode.adaptive import CostTable, OnlineAcceptance, choose_draft_counts, survivals


def _rate(surv, counts, verify_cost, draft_cost):
    R = surv.shape[0]
    gain = sum(float(surv[r, : counts[r]].sum()) for r in range(R))
    return (R + gain) / (draft_cost + verify_cost(R + sum(counts)))


def test_budget_is_the_best_prefix_allocation_by_brute_force():
    g = torch.Generator().manual_seed(0)
    verify = lambda n: 1.0 + 0.3 * n
    for _ in range(20):
        conf = torch.rand(3, 4, generator=g)
        surv = survivals(conf)
        counts, budget = choose_draft_counts(surv, verify, draft_cost=0.5)
        assert sum(counts) == budget
        best = max(
            _rate(surv, c, verify, 0.5) for c in itertools.product(range(5), repeat=3)
        )  # every per-request prefix length
        assert _rate(surv, counts, verify, 0.5) == pytest.approx(best)


def test_chosen_slots_are_a_prefix_of_each_request_and_ties_go_to_lower_rows():
    surv = survivals(torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]))
    # A cost that makes exactly three extra tokens worth it.
    verify = lambda n: 1.0 if n <= 5 else 100.0
    counts, budget = choose_draft_counts(surv, verify, draft_cost=0.0)
    assert budget == 3
    assert counts == [2, 1]  # equal survivals: row 0 first, then row 1


def test_free_verification_verifies_everything_and_costly_verification_nothing():
    surv = survivals(torch.full((2, 3), 0.5))
    assert choose_draft_counts(surv, lambda n: 1.0, 0.0)[0] == [3, 3]
    assert choose_draft_counts(surv, lambda n: float(n) ** 3, 0.0)[0] == [0, 0]


def test_cost_table_interpolates_medians_and_extrapolates():
    t = CostTable()
    for n, s in ((1, 1.0), (1, 9.0), (1, 2.0), (4, 4.0), (8, 6.0)):
        t.observe(n, s)
    assert t.table() == [(1, 2.0), (4, 4.0), (8, 6.0)]
    assert t(1) == 2.0
    assert t(2) == pytest.approx(2.0 + 2.0 / 3.0)
    assert t(16) == pytest.approx(10.0)  # the last segment's slope, 0.5 per token


def test_online_estimator_recovers_a_known_acceptance_model():
    g = torch.Generator().manual_seed(1)
    omega, beta = 1.2, [0.5, -0.5, -1.0]
    est = OnlineAcceptance(k=3, refit_every=10**9)
    feats, slots, labels = [], [], []
    for _ in range(4000):
        i = int(torch.randint(0, 3, (), generator=g))
        f = float(torch.randn((), generator=g) * 2)
        p = float(torch.sigmoid(torch.tensor(omega * f + beta[i])))
        feats.append(f)
        slots.append(i)
        labels.append(int(float(torch.rand((), generator=g)) < p))
    est.observe(feats, slots, labels)
    for _ in range(8):  # damped Newton steps
        est.refit()
    assert est.theta[0].item() == pytest.approx(omega, abs=0.15)
    assert est.theta[1:].tolist() == pytest.approx(beta, abs=0.2)


def test_online_feature_is_the_clamped_logit_of_the_top_probability():
    f = OnlineAcceptance.feature(torch.tensor([0.5, 0.9, 1.0, 0.0]))
    assert f.tolist() == pytest.approx([0.0, 2.1972245773, 36.7368005696, -40.0], abs=1e-6)
