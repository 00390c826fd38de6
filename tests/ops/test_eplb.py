"""Expert-parallel load balancing: the placement's invariants, its determinism and tie-breaking, the
balance it reaches on constructed loads, and the routing of logical ids onto replicas."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops.eplb import (
    ExpertMove,
    balance_experts,
    identity_placement,
    imbalance,
    initial_placement,
    logical_to_physical,
    placement_of,
    plan_moves,
    rank_loads,
)


def _skewed(layers: int, logical: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, logical + 1, dtype=torch.float64) ** 1.1
    loads = torch.stack([popularity[torch.randperm(logical, generator=g)] for _ in range(layers)])
    return (loads * 10_000).round()


def _check_invariants(p, logical: int, physical: int, ranks: int, nodes: int = 1) -> None:
    layers = p.phy_to_log.shape[0]
    assert p.phy_to_log.shape == (layers, physical) and p.phy_to_log.dtype == torch.int64
    assert p.replica_count.shape == (layers, logical)
    assert p.log_to_phys.shape[:2] == (layers, logical)
    assert p.log_to_phys.shape[2] == int(p.replica_count.max())
    assert int(p.replica_count.min()) >= 1
    assert p.replica_count.sum(1).tolist() == [physical] * layers
    per_rank = physical // ranks
    for layer in range(layers):
        row = p.phy_to_log[layer].tolist()
        assert all(0 <= e < logical for e in row)
        for e in range(logical):
            c = int(p.replica_count[layer, e])
            slots = p.log_to_phys[layer, e].tolist()
            assert slots[c:] == [-1] * (len(slots) - c)
            assert slots[:c] == sorted(i for i, x in enumerate(row) if x == e)
            homes = [s // per_rank for s in slots[:c]]
            if c <= ranks // nodes:  # avoidable in these cases: replicas on distinct ranks (of a node)
                assert len(set(homes)) == c, (layer, e, homes)
        # each rank holds exactly per_rank slots, in ascending logical order
        for r in range(ranks):
            chunk = row[r * per_rank : (r + 1) * per_rank]
            assert chunk == sorted(chunk)


@pytest.mark.parametrize(
    "logical,redundant,ranks,groups,nodes",
    [
        (16, 0, 4, 1, 1),
        (16, 4, 4, 1, 1),
        (32, 8, 8, 1, 1),
        (32, 24, 8, 1, 1),
        (32, 16, 8, 4, 2),
        (64, 8, 8, 8, 4),
    ],
)
def test_invariants(logical, redundant, ranks, groups, nodes):
    loads = _skewed(3, logical, seed=logical + redundant)
    physical = logical + redundant
    p = balance_experts(loads, physical, ranks, groups=groups, nodes=nodes)
    _check_invariants(p, logical, physical, ranks, nodes)


def test_deterministic():
    loads = _skewed(4, 64, seed=1)
    a = balance_experts(loads, 80, 16)
    b = balance_experts(loads.clone(), 80, 16)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_ties_break_by_lower_index():
    # equal loads, no redundancy: expert e goes to rank e % ranks (heaviest-first order is by id,
    # the least-loaded rank with room is the lowest one)
    p = balance_experts(torch.ones(1, 8), 8, 4)
    assert p.phy_to_log[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # two equally hot experts: the first redundant slot goes to the lower id
    loads = torch.tensor([[1.0, 5.0, 5.0, 1.0]])
    p = balance_experts(loads, 6, 2)  # two redundant slots: 1 first, then 2 (5 > 2.5)
    assert p.replica_count[0].tolist() == [1, 2, 2, 1]
    p = balance_experts(torch.tensor([[1.0, 5.0, 5.0, 1.0, 0.0]]), 6, 3)
    assert p.replica_count[0].tolist() == [1, 2, 1, 1, 1]


def test_one_hot_expert_bound():
    # 16 experts on 4 ranks, expert 0 carries 10x the others, one redundant slot per rank.
    # Replication: 10 -> 5 -> 3.33 -> 2.5 -> 2, so expert 0 gets 5 replicas of load 2 (5 > 4 ranks: one
    # rank holds two); the 15 others carry 1 each. Packing (20 slots, 5 per rank): the four first
    # replicas of 0 go one per rank, the fifth onto rank 0 (all tie at 2), and the fifteen ones fill the
    # least-loaded ranks: [7, 6, 6, 6]. The mean is 25 / 4 = 6.25, so max/mean = 1.12, the best any
    # placement reaches here (some rank carries >= 7 of integer-valued replicas summing to 25).
    loads = torch.ones(1, 16)
    loads[0, 0] = 10
    p = balance_experts(loads, 20, 4)
    per_rank = rank_loads(p.phy_to_log, loads, 4)
    assert per_rank[0].tolist() == [7.0, 6.0, 6.0, 6.0]
    assert float(imbalance(per_rank)[0]) == pytest.approx(1.12)
    # without balancing (experts 0-3 on rank 0): 13 / 6.25 = 2.08
    base = rank_loads(identity_placement(1, 16).phy_to_log, loads, 4)
    assert float(imbalance(base)[0]) == pytest.approx(2.08)


def test_balancing_lowers_imbalance_on_skewed_loads():
    loads = _skewed(4, 64, seed=3)
    base = imbalance(rank_loads(identity_placement(4, 64).phy_to_log, loads, 8))
    # without redundancy the rank holding the hottest expert carries it and at least the 7 lightest
    # (8 slots per rank): no placement beats that, and greedy reaches it on these loads
    lightest = loads.sort(1).values[:, :7].sum(1)
    floor = (loads.max(1).values + lightest) / (loads.sum(1) / 8)
    p = balance_experts(loads, 64, 8)
    after = imbalance(rank_loads(p.phy_to_log, loads, 8))
    assert bool((after < base).all()) and bool((after <= floor * 1.001).all()), (after, floor, base)
    for redundant in (8, 16):
        p = balance_experts(loads, 64 + redundant, 8)
        after = imbalance(rank_loads(p.phy_to_log, loads, 8))
        assert float(after.max()) <= 1.02, (redundant, after)


def test_hierarchical_keeps_groups_within_a_node():
    loads = _skewed(2, 32, seed=5)
    p = balance_experts(loads, 48, 8, groups=8, nodes=2)  # 4 experts per group, 24 slots per node
    for layer in range(2):
        for node in range(2):
            held = set(p.phy_to_log[layer, node * 24 : (node + 1) * 24].tolist())
            groups = {e // 4 for e in held}
            assert len(groups) == 4 and held == {g * 4 + j for g in groups for j in range(4)}


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        balance_experts(torch.ones(1, 16), 18, 4)  # 18 % 4 != 0
    with pytest.raises(ValueError):
        balance_experts(torch.ones(1, 16), 12, 4)  # fewer slots than experts
    with pytest.raises(ValueError):
        balance_experts(torch.ones(1, 16), 20, 4, groups=3, nodes=2)


def test_logical_to_physical_spreads_and_maps():
    loads = torch.ones(1, 16)
    loads[0, 0] = 10
    loads[0, 3] = 4
    p = balance_experts(loads, 24, 4)
    l2p, count = p.log_to_phys[0], p.replica_count[0]
    assert int(count[0]) > 1 and int(count[3]) > 1
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(101)])
    ids[ids == 5] = -1  # padding
    ids[:50, 0] = 0
    for salt in (0, 3, torch.tensor(7)):
        slots = logical_to_physical(ids, l2p, count, salt)
        assert slots.shape == ids.shape and slots.dtype == torch.int64
        assert torch.equal(slots == -1, ids == -1)
        live = ids >= 0
        assert torch.equal(p.phy_to_log[0][slots[live]], ids[live])
        for e in range(16):
            hits = torch.bincount(slots[ids == e], minlength=24)[l2p[e, : int(count[e])]]
            assert int(hits.max() - hits.min()) <= 1, (e, hits)
            assert int(hits.sum()) == int((ids == e).sum())


def test_logical_to_physical_without_replicas_is_the_map():
    p = identity_placement(1, 8)
    ids = torch.tensor([[3, 1], [7, -1]])
    assert torch.equal(logical_to_physical(ids, p.log_to_phys[0], p.replica_count[0]), ids)


def test_initial_placement_is_vllms():
    """vLLM's ``build_initial_global_physical_to_logical_map``: experts in order, then the redundant
    slots hold experts 0, 1, ...; without redundancy it is the identity."""
    p = initial_placement(2, 8, 10)
    assert p.phy_to_log.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 2
    assert p.replica_count[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert p.log_to_phys[0, 0].tolist() == [0, 8] and p.log_to_phys[0, 7].tolist() == [7, -1]
    assert torch.equal(initial_placement(3, 8, 8).phy_to_log, identity_placement(3, 8).phy_to_log)
    with pytest.raises(ValueError, match="physical >= logical"):
        initial_placement(1, 8, 7)
    with pytest.raises(ValueError, match="at least one physical slot"):
        placement_of(torch.tensor([[0, 0, 1]]), 3)


def test_plan_moves_applied_gives_the_new_placement():
    """Applying the plan to the old slots' contents yields the new placement; sources are local
    where the destination's rank held the expert, and spread over holders otherwise."""
    old = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1])  # 2 ranks of 5 slots
    new = torch.tensor([0, 4, 5, 5, 6, 1, 2, 3, 7, 7])
    moves = plan_moves(old, new, ranks=2)
    assert [m.dst for m in moves] == sorted(m.dst for m in moves)
    held = old.tolist()
    after = list(held)
    for m in moves:
        after[m.dst] = held[m.src]  # every source read from the old contents
    assert after == new.tolist()
    # Slot 1 (rank 0) needs expert 4, which rank 0 held in slot 4: a local copy.
    assert ExpertMove(4, 1) in moves
    # Unchanged slots need nothing.
    assert all(old[m.dst] != new[m.dst] for m in moves)
    assert plan_moves(old, old, ranks=2) == []
    with pytest.raises(ValueError, match="no slot in the old placement"):
        plan_moves(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2, 1, 1]), ranks=2)
