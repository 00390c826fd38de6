"""Expert load balancing on the CPU at DP=2: two gloo processes (data parallel 2, the experts split over
both, as ``--data-parallel-size 2 --enable-expert-parallel``) run a stack of V4.1 MoE routed-expert layers
(``RoutedExperts.forward``: gather, this rank's slots, one sum over the group) on a skewed decode
workload, with and without balancing (``model_executor.eplb.ExpertBalancer``, one redundant expert per
rank, weights moved between the processes at the rebalance).

Workload: repeated text, every token one of a few distinct hidden states plus a little noise, routed by
the model's router (``route_sqrtsoftplus``) with a random gate per layer, so most pairs go to a few
experts. Reported, per layer and step, averaged: max/mean (token, expert) pairs received per rank, before
balancing (vLLM's initial placement) and after the rebalance; and the decode step time (all layers, both
ranks waiting on the group's sums, so the busier rank sets it), balanced vs unbalanced, interleaved step
by step on the same tokens, as a ratio.

Run: ``.venv/bin/python benchmarks/eplb_cpu.py`` (options: ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "model_executor")
)
from eplb_ranks import Coordinator  # the gloo stand-in for vLLM's group coordinator

PREDICTION = """\
Prediction (written before the first run): 64 experts top 6 on 2 ranks, 8 distinct states: before
max/mean ~ 1.3-1.5 per step (at most 2 with 2 ranks); after one rebalance with one redundant expert per
rank ~ 1.05. Routed-expert time on the CPU grows with a rank's pairs, so the balanced decode step ~ 0.8x
the unbalanced one (the busier rank's share falls from ~ 0.7 to ~ 0.53 of the pairs), less the map's
small cost."""


def _layers(args, layout, redundant, seed):
    from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts
    from deepinfer_vllm.ops import quant

    g = torch.Generator().manual_seed(seed)
    layers = [
        RoutedExperts(args.experts, args.hidden, args.inter, layout, redundant) for _ in range(args.layers)
    ]
    for lay in layers:
        for e in range(args.experts):
            for proj, (rows, cols) in {
                "w1": (args.inter, args.hidden),
                "w3": (args.inter, args.hidden),
                "w2": (args.hidden, args.inter),
            }.items():
                packed, scale = quant.quant_fp4_rows(torch.randn(rows, cols, generator=g) * 0.05)
                lay.load_expert(proj, "weight", e, packed)
                lay.load_expert(proj, "scale", e, scale)
    return layers


def _workload(args, rank):
    """Per step and layer: (x, weights, ids) of this rank's decode tokens."""
    from deepinfer_vllm.ops.moe import route_sqrtsoftplus

    g = torch.Generator().manual_seed(11)
    states = torch.randn(args.distinct, args.hidden, generator=g)
    gates = [torch.randn(args.experts, args.hidden, generator=g) for _ in range(args.layers)]
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(args.warm + args.steps):
        x = states[torch.randint(args.distinct, (args.batch,), generator=g)]
        x = x + args.noise * torch.randn(x.shape, generator=g)
        steps.append([(x, *route_sqrtsoftplus(x, gate, None, args.top_k, 1.5)) for gate in gates])
    return steps


def rank_main(rank, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import vllm.distributed
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from deepinfer_vllm.model_executor.eplb import EplbSettings, ExpertBalancer
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    coord = Coordinator()
    vllm.distributed.get_dp_group = lambda: coord
    vllm.distributed.get_ep_group = lambda: coord
    layout = ParallelLayout(dp_size=2, dp_rank=rank, expert_parallel=True)
    redundant = 2  # one per rank
    plain = _layers(args, layout, None, seed=5)
    bal = _layers(args, layout, redundant, seed=5)

    class Model(MixtureOfExperts):
        def __init__(self):
            self.moe_layers = bal
            self.num_moe_layers = len(bal)
            self.num_logical_experts = args.experts
            self.num_physical_experts = args.experts + redundant
            self.expert_weights = []

    balancer = ExpertBalancer(
        Model(), EplbSettings(args.warm, args.warm, redundant, False, "deepinfer"), coord
    )
    work = _workload(args, rank)

    def step(layers, tokens):
        dist.barrier()
        t0 = time.perf_counter()
        for lay, (x, w, ids) in zip(layers, tokens):
            lay(x, w, ids, 10.0)
        dist.barrier()
        return time.perf_counter() - t0

    imb_before, imb_after, t_plain, t_bal = [], [], [], []
    for s, tokens in enumerate(work):
        tb = step(bal, tokens)
        tp = step(plain, tokens)
        counts = coord.all_reduce(balancer.load_pass.clone()).view(args.layers, 2, -1).sum(-1).double()
        imb = (counts.max(-1).values / counts.mean(-1)).mean().item()
        if s < args.warm:
            imb_before.append(imb)
        else:
            imb_after.append(imb)
            t_plain.append(tp)
            t_bal.append(tb)
        balancer.step()
        t0 = time.perf_counter()
        balancer.run_pending()  # rebalances after the warm steps
        if s == args.warm - 1:
            rebalance_s = time.perf_counter() - t0
    if rank == 0:
        t_plain.sort()
        t_bal.sort()
        mid = len(t_plain) // 2
        with open(out_path, "w") as f:
            json.dump(
                {
                    "before": sum(imb_before) / len(imb_before),
                    "after": sum(imb_after) / len(imb_after),
                    "after_worst": max(imb_after),
                    "plain_ms": 1e3 * t_plain[mid],
                    "balanced_ms": 1e3 * t_bal[mid],
                    "rebalance_s": rebalance_s,
                    "moved": balancer.moved_rebalances,
                },
                f,
            )
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="decode tokens per rank per step")
    p.add_argument("--distinct", type=int, default=8, help="distinct hidden states of the repeated text")
    p.add_argument("--noise", type=float, default=0.25)
    p.add_argument("--warm", type=int, default=8, help="steps on the initial placement (the window)")
    p.add_argument("--steps", type=int, default=16, help="measured steps after the rebalance")
    args = p.parse_args(argv)
    from vllm.utils.network_utils import get_open_port

    print(PREDICTION)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(rank_main, args=(get_open_port(), args, out), nprocs=2)
        with open(out) as f:
            r = json.load(f)
    print(
        f"\n{args.experts} experts top {args.top_k}, hidden {args.hidden}, inter {args.inter}, {args.layers} layers, "
        f"{args.batch} decode tokens per rank, DP=2 + EP, 1 redundant expert per rank, {args.distinct} states"
    )
    print(
        "| max/mean pairs per rank per step, before | after | after, worst step | decode step unbalanced (ms) "
        "| balanced (ms) | balanced / unbalanced | rebalance (s) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {r['before']:.3f} | {r['after']:.3f} | {r['after_worst']:.3f} | {r['plain_ms']:.1f} | "
        f"{r['balanced_ms']:.1f} | {r['balanced_ms'] / r['plain_ms']:.3f} | {r['rebalance_s']:.3f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
