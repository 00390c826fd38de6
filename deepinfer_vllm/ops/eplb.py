"""Expert-parallel load balancing (EPLB): where each routed expert's replicas live, and which replica a
routed token uses.

A *logical* expert is one of the model's routed experts; a *physical* slot is one expert's weights held
by one rank. With ``physical = logical + redundant`` slots over ``ranks`` ranks, every rank holds
``physical // ranks`` consecutive slots: slot ``i`` lives on rank ``i // (physical // ranks)``.

Placement (``balance_experts``), per layer, from the loads of a past window (tokens routed to each
logical expert):

1. **Replication.** Every logical expert starts with one replica; each redundant slot in turn goes to
   the expert with the largest load per replica (ties: lower expert id). A replica carries
   ``load / replicas`` of its expert's load (the router's traffic is spread evenly over replicas, see
   ``logical_to_physical``).
2. **Packing.** Replicas are placed heaviest first (ties: lower expert id) onto the least-loaded rank
   that still has a free slot and does not hold that expert yet (ties: lower rank); only when every
   rank with room already holds the expert does a replica join one of those. A repair pass then swaps
   slots between ranks to separate any replicas that still share a rank where a swap can do it, and a
   local search swaps replicas between the most-loaded rank and another while that lowers the peak.
3. **Hierarchical variant** (``nodes > 1``): the ``groups`` expert groups (consecutive logical ids) are
   first packed onto the nodes, equally many groups per node, heaviest group first onto the
   least-loaded node with room; then steps 1 and 2 run inside each node with its share of the slots
   and ranks, so a token's experts stay within as few nodes as the groups allow.

Within a rank, slots are ordered by logical id. With equal loads and ``redundant=0`` the result is the
round-robin placement (expert ``e`` on rank ``e % ranks`` in the global variant), not the contiguous
one that ``ParallelLayout.local_experts`` uses; both are balanced.

Routing (``logical_to_physical``): the j-th (token, choice) pair, in flattened ``[T, k]`` order, that
chose expert ``e`` goes to replica ``(j + salt) % replica_count[e]``, so an expert's tokens in one batch
split over its replicas within one of each other. Pure tensor ops with no host synchronisation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "ExpertMove",
    "ExpertPlacement",
    "balance_experts",
    "identity_placement",
    "imbalance",
    "initial_placement",
    "logical_to_physical",
    "placement_of",
    "plan_moves",
    "rank_loads",
]


class ExpertPlacement(NamedTuple):
    """One placement of logical experts onto physical slots, per layer (int64 tensors).

    * ``phy_to_log [layers, physical]``: the logical expert slot ``i`` holds;
    * ``log_to_phys [layers, logical, max_replicas]``: the slots holding each logical expert in
      ascending slot order, padded with -1 (``max_replicas`` is the largest count over all layers);
    * ``replica_count [layers, logical]``: how many slots hold each logical expert (at least 1).
    """

    phy_to_log: torch.Tensor
    log_to_phys: torch.Tensor
    replica_count: torch.Tensor


def _replicate(loads: torch.Tensor, redundant: int) -> torch.Tensor:
    """Replica counts ``[layers, n]`` after giving ``redundant`` extra replicas, one at a time, to the
    expert with the largest load per replica (``argmax`` returns the first maximum: lower id wins)."""
    counts = torch.ones(loads.shape, dtype=torch.int64, device="cpu")
    rows = torch.arange(loads.shape[0], device="cpu")
    for _ in range(redundant):
        best = torch.argmax(loads / counts, dim=1)
        counts[rows, best] += 1
    return counts


def _pack(weights: list[float], keys: list[int], bins: int) -> list[int]:
    """Bin of each item when ``len(weights)`` items go into ``bins`` bins of equal item count.

    Heaviest item first (ties: lower key, then lower item index) onto the least-loaded bin with room
    (ties: lower bin), preferring bins that hold no item with the same key; then a repair pass swaps
    items between bins to separate equal keys sharing a bin where that is possible.
    """
    n = len(weights)
    cap = n // bins
    load = [0.0] * bins
    fill = [0] * bins
    held: list[dict[int, int]] = [{} for _ in range(bins)]
    where = [-1] * n
    for i in sorted(range(n), key=lambda i: (-weights[i], keys[i], i)):
        key = keys[i]
        best = -1
        best_any = -1
        for b in range(bins):
            if fill[b] == cap:
                continue
            if best_any < 0 or load[b] < load[best_any]:
                best_any = b
            if key not in held[b] and (best < 0 or load[b] < load[best]):
                best = b
        b = best if best >= 0 else best_any
        where[i] = b
        load[b] += weights[i]
        fill[b] += 1
        held[b][key] = held[b].get(key, 0) + 1
    _separate(weights, keys, where, load, held)
    _lower_peak(weights, keys, where, load, held)
    return where


def _swap(
    i: int,
    a: int,
    j: int,
    b: int,
    weights: list[float],
    keys: list[int],
    where: list[int],
    load: list[float],
    held: list[dict[int, int]],
    by_bin: list[list[int]],
) -> None:
    """Item ``i`` (in bin ``a``) and item ``j`` (in bin ``b``) trade bins; loads and key counts follow."""
    for item, src, dst in ((i, a, b), (j, b, a)):
        by_bin[src].remove(item)
        by_bin[dst].append(item)
        where[item] = dst
        load[src] -= weights[item]
        load[dst] += weights[item]
        held[src][keys[item]] -= 1
        if held[src][keys[item]] == 0:
            del held[src][keys[item]]
        held[dst][keys[item]] = held[dst].get(keys[item], 0) + 1


def _lower_peak(
    weights: list[float], keys: list[int], where: list[int], load: list[float], held: list[dict[int, int]]
) -> None:
    """Local search on the greedy packing: while one swap of an item of the most-loaded bin ``a`` with a
    lighter item of another bin lowers the larger of the two bins' loads below ``a``'s, make the swap
    that lowers it most (ties: lower bin, then lower items). Swaps never put two items of one key in a
    bin. Stops at the first peak no single swap lowers (or after ``4 * items`` swaps)."""
    bins = len(held)
    by_bin: list[list[int]] = [[] for _ in range(bins)]
    for i, b in enumerate(where):
        by_bin[b].append(i)
    for _ in range(4 * len(weights)):
        a = max(range(bins), key=lambda b: (load[b], -b))
        peak = load[a]
        tol = 1e-12 * max(peak, 1.0)
        best = None
        for b in range(bins):
            if b == a:
                continue
            for i in sorted(by_bin[a]):
                if keys[i] in held[b]:
                    continue
                for j in sorted(by_bin[b]):
                    d = weights[i] - weights[j]
                    if d <= tol or keys[j] in held[a]:
                        continue
                    new = max(peak - d, load[b] + d)
                    if new < peak - tol and (best is None or new < best[0] - tol):
                        best = (new, b, i, j)
        if best is None:
            return
        _, b, i, j = best
        _swap(i, a, j, b, weights, keys, where, load, held, by_bin)


def _separate(
    weights: list[float], keys: list[int], where: list[int], load: list[float], held: list[dict[int, int]]
) -> None:
    """Swap items so that no bin holds two items of one key where a swap with another bin can undo it:
    the item of key ``k`` doubled in bin ``a`` trades places with an item of key ``f`` in a bin ``b``
    that lacks ``k``, with ``f`` absent from ``a``; the closest weight wins (ties: lower item)."""
    bins = len(held)
    by_bin: list[list[int]] = [[] for _ in range(bins)]
    for i, b in enumerate(where):
        by_bin[b].append(i)
    changed = True
    while changed:
        changed = False
        for a in range(bins):
            for i in list(by_bin[a]):
                k = keys[i]
                if held[a][k] < 2:
                    continue
                best = None
                for b in range(bins):
                    if b == a or k in held[b]:
                        continue
                    for j in by_bin[b]:
                        f = keys[j]
                        if f in held[a]:
                            continue
                        cand = (abs(weights[i] - weights[j]), j)
                        if best is None or cand < best[0]:
                            best = (cand, b, j)
                if best is None:
                    continue
                _, b, j = best
                _swap(i, a, j, b, weights, keys, where, load, held, by_bin)
                changed = True


def _log_to_phys(phy_to_log: torch.Tensor, logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_to_phys [layers, logical, max_replicas] padded with -1, replica_count [layers, logical])``
    from ``phy_to_log [layers, physical]``; replicas in ascending slot order."""
    layers, physical = phy_to_log.shape
    counts = torch.zeros(layers, logical, dtype=torch.int64, device="cpu")
    counts.scatter_add_(1, phy_to_log, torch.ones_like(phy_to_log))
    width = max(int(counts.max()), 1)
    order = torch.sort(phy_to_log, dim=1, stable=True).indices  # slots grouped by expert, ascending
    sorted_log = phy_to_log.gather(1, order)
    starts = torch.cumsum(counts, dim=1) - counts
    replica = torch.arange(physical, device="cpu").expand(layers, -1) - starts.gather(1, sorted_log)
    out = torch.full((layers, logical, width), -1, dtype=torch.int64, device="cpu")
    out.view(layers, -1).scatter_(1, sorted_log * width + replica, order)
    return out, counts


def identity_placement(layers: int, logical: int) -> ExpertPlacement:
    """The placement without balancing: one replica per expert, slot ``e`` holds expert ``e`` (with
    ``ranks`` dividing ``logical``, the contiguous split of ``ParallelLayout.local_experts``)."""
    phy_to_log = torch.arange(logical, device="cpu").expand(layers, -1).contiguous()
    return ExpertPlacement(phy_to_log, *_log_to_phys(phy_to_log, logical))


def initial_placement(layers: int, logical: int, physical: int) -> ExpertPlacement:
    """The placement a balanced model starts from, vLLM's (``EplbState.build_initial_global_physical_to_
    logical_map``): slot ``i`` holds expert ``i`` for ``i < logical``, and redundant slot ``logical + j``
    holds expert ``j % logical``. With ``physical == logical`` it is ``identity_placement``."""
    if physical < logical:
        raise ValueError(f"need physical >= logical: {physical=} {logical=}")
    row = torch.cat(
        [torch.arange(logical, device="cpu"), torch.arange(physical - logical, device="cpu") % logical]
    )
    return placement_of(row.expand(layers, -1).contiguous(), logical)


def placement_of(phy_to_log: torch.Tensor, logical: int) -> ExpertPlacement:
    """The ``ExpertPlacement`` of a ``phy_to_log [layers, physical]`` map (every expert at least once)."""
    phy_to_log = phy_to_log.to("cpu", torch.int64)
    if phy_to_log.dim() != 2 or bool((phy_to_log < 0).any()) or bool((phy_to_log >= logical).any()):
        raise ValueError(f"phy_to_log must be [layers, physical] with ids in [0, {logical})")
    placement = ExpertPlacement(phy_to_log, *_log_to_phys(phy_to_log, logical))
    if int(placement.replica_count.min()) < 1:
        raise ValueError("every logical expert needs at least one physical slot")
    return placement


class ExpertMove(NamedTuple):
    """One expert's weights going from physical slot ``src`` (old placement) to slot ``dst`` (new)."""

    src: int
    dst: int


def plan_moves(old: torch.Tensor, new: torch.Tensor, ranks: int) -> list[ExpertMove]:
    """The copies that turn one layer's placement ``old [physical]`` into ``new [physical]``, in
    ascending ``dst`` order: one per slot whose expert changes. The source is a slot on the
    destination's own rank when that rank held the expert (a local copy), otherwise the holder
    (under ``old``) that has sent least so far in this plan (ties: lower slot). Deterministic, so
    every rank computes the same plan; slots that keep their expert need nothing."""
    old_l, new_l = old.tolist(), new.tolist()
    physical = len(old_l)
    if len(new_l) != physical or physical % ranks:
        raise ValueError(f"old and new must have the same length, divisible by {ranks=}")
    per = physical // ranks
    holders: dict[int, list[int]] = {}
    for slot, e in enumerate(old_l):
        holders.setdefault(e, []).append(slot)
    sent = [0] * ranks
    moves = []
    for dst, e in enumerate(new_l):
        if old_l[dst] == e:
            continue
        if e not in holders:
            raise ValueError(f"expert {e} has no slot in the old placement")
        rank = dst // per
        local = [s for s in holders[e] if s // per == rank]
        if local:
            src = local[0]
        else:
            src = min(holders[e], key=lambda s: (sent[s // per], s))
            sent[src // per] += 1
        moves.append(ExpertMove(src, dst))
    return moves


def balance_experts(
    loads: torch.Tensor, physical: int, ranks: int, groups: int = 1, nodes: int = 1
) -> ExpertPlacement:
    """The balanced placement of ``loads [layers, logical]`` (tokens per logical expert over a window)
    on ``physical`` slots over ``ranks`` ranks; hierarchical over ``nodes`` nodes when ``nodes > 1``,
    with ``groups`` groups of consecutive logical experts (module docstring). Deterministic.

    Requires ``physical >= logical``, ``physical % ranks == 0``; with ``nodes > 1`` also
    ``logical % groups == 0``, ``groups % nodes == 0``, ``ranks % nodes == 0`` and
    ``(physical - logical) % nodes == 0``.
    """
    if loads.dim() != 2:
        raise ValueError(f"loads must be [layers, logical], got shape {tuple(loads.shape)}")
    layers, logical = loads.shape
    if physical < logical or ranks < 1 or physical % ranks:
        raise ValueError(
            f"need physical >= logical and physical % ranks == 0: {physical=} {logical=} {ranks=}"
        )
    if nodes > 1 and (logical % groups or groups % nodes or ranks % nodes or (physical - logical) % nodes):
        raise ValueError(
            f"hierarchical balancing needs logical % groups, groups % nodes, ranks % nodes and "
            f"(physical - logical) % nodes all 0: {logical=} {groups=} {nodes=} {ranks=} {physical=}"
        )
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    loads = loads.detach().to("cpu", torch.float64)
    if bool((loads < 0).any()) or not bool(torch.isfinite(loads).all()):
        raise ValueError("loads must be finite and non-negative")
    per_rank = physical // ranks
    ranks_per_node = ranks // nodes
    redundant_per_node = (physical - logical) // nodes
    group_size = logical // groups if nodes > 1 else logical
    n_groups = groups if nodes > 1 else 1

    phy_to_log = torch.empty(layers, physical, dtype=torch.int64, device="cpu")
    for layer in range(layers):
        row = loads[layer]
        group_load = row.view(n_groups, group_size).sum(1).tolist()
        node_of_group = _pack(group_load, list(range(n_groups)), nodes)
        for node in range(nodes):
            experts = [
                g * group_size + j
                for g in range(n_groups)
                if node_of_group[g] == node
                for j in range(group_size)
            ]
            node_loads = row[experts]
            counts = _replicate(node_loads.unsqueeze(0), redundant_per_node)[0].tolist()
            weights: list[float] = []
            keys: list[int] = []
            for e, load, c in zip(experts, node_loads.tolist(), counts):
                weights += [load / c] * c
                keys += [e] * c
            rank_of = _pack(weights, keys, ranks_per_node)
            base = node * ranks_per_node
            for r in range(ranks_per_node):
                held = sorted(keys[i] for i in range(len(keys)) if rank_of[i] == r)
                start = (base + r) * per_rank
                phy_to_log[layer, start : start + per_rank] = torch.tensor(
                    held, dtype=torch.int64, device="cpu"
                )
    return ExpertPlacement(phy_to_log, *_log_to_phys(phy_to_log, logical))


def logical_to_physical(
    ids: torch.Tensor, log_to_phys: torch.Tensor, replica_count: torch.Tensor, salt: int | torch.Tensor = 0
) -> torch.Tensor:
    """Physical slots ``[T, k]`` for the routed logical ``ids [T, k]`` of one layer, given that layer's
    ``log_to_phys [logical, max_replicas]`` and ``replica_count [logical]``; negative ids (padding) stay -1.

    The j-th occurrence of expert ``e`` in the flattened ``ids`` (row-major) takes replica
    ``(j + salt) % replica_count[e]``: an expert's pairs split over its replicas within one of each
    other, and ``salt`` (an int or a 0-d tensor, e.g. a step counter) rotates which replicas get the
    extra pair. Sort-and-scatter tensor ops only: no host synchronisation.
    """
    logical = replica_count.shape[0]
    flat = ids.reshape(-1)
    valid = flat >= 0
    bucket = torch.where(valid, flat, torch.full_like(flat, logical))  # padding in an extra bucket
    n = flat.shape[0]
    counts = torch.zeros(logical + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(bucket, stable=True).indices
    occurrence = torch.empty_like(bucket)
    occurrence[order] = torch.arange(n, device=ids.device) - starts[bucket[order]]
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    count = replica_count.to(ids.device)[safe]
    replica = (occurrence + salt) % count
    slots = log_to_phys.to(ids.device)[safe, replica]
    return torch.where(valid, slots, torch.full_like(slots, -1)).view(ids.shape)


def rank_loads(phy_to_log: torch.Tensor, loads: torch.Tensor, ranks: int) -> torch.Tensor:
    """Per-rank load ``[layers, ranks]`` (or ``[ranks]`` for 1-D inputs) of placing ``loads
    [layers, logical]`` by ``phy_to_log [layers, physical]``: every slot carries its expert's load
    divided by the expert's replica count; a rank sums its ``physical // ranks`` slots."""
    squeeze = phy_to_log.dim() == 1
    if squeeze:
        phy_to_log, loads = phy_to_log.unsqueeze(0), loads.unsqueeze(0)
    layers, physical = phy_to_log.shape
    loads = loads.to(torch.float64)
    counts = torch.zeros(loads.shape, dtype=torch.float64, device=loads.device)
    counts.scatter_add_(1, phy_to_log, torch.ones(phy_to_log.shape, dtype=torch.float64, device=loads.device))
    slot = loads.gather(1, phy_to_log) / counts.gather(1, phy_to_log)
    out = slot.view(layers, ranks, physical // ranks).sum(-1)
    return out[0] if squeeze else out


def imbalance(per_rank: torch.Tensor) -> torch.Tensor:
    """``max / mean`` over the last dimension (1.0 is perfect balance); NaN where the mean is 0."""
    per_rank = per_rank.to(torch.float64)
    return per_rank.max(-1).values / per_rank.mean(-1)
