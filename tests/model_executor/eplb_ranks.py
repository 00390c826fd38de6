"""Two gloo ranks (data parallel 2, experts split over both) run V4.1's routed experts
(``RoutedExperts.forward``) three ways on the same skewed tokens, step after step: without load
balancing, with it (``model_executor.eplb.ExpertBalancer``, 2 redundant slots, a rebalance every 3
steps, weights moved between the two processes), and on one rank holding every expert. Rank 0 writes
what it saw to a JSON file for ``test_eplb_model.py``.

Both modes run: ``fp32`` (float32 tokens) and ``bf16-bi`` (bfloat16 with ``DEEPINFER_BATCH_INVARIANT=1``).
Then, in one process, vLLM's own ``EplbState`` drives the same layers (``vllm_state``) as far as it runs
on a CPU.

Run: ``python eplb_ranks.py PORT OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, INTER, EXPERTS, TOP_K, REDUNDANT, LAYERS = 64, 64, 8, 2, 2, 2
STEPS, WINDOW, INTERVAL = 12, 3, 3
LIMIT = 2.0


class Coordinator:
    """The parts of vLLM's ``GroupCoordinator`` the MoE exchange and the balancer use (gloo)."""

    def __init__(self):
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()
        self.cpu_group = self.device_group = dist.group.WORLD

    def all_reduce(self, t):
        dist.all_reduce(t, group=self.cpu_group)
        return t


def _checkpoint(seed: int):
    """Every expert's checkpoint tensors ``{(expert, proj, kind): tensor}`` (packed E2M1, UE8M0)."""
    from deepinfer_vllm.ops import quant

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, (rows, cols) in {
                "w1": (INTER, HIDDEN),
                "w3": (INTER, HIDDEN),
                "w2": (HIDDEN, INTER),
            }.items():
                packed, scale = quant.quant_fp4_rows(torch.randn(rows, cols, generator=g) * 0.2)
                out[(layer, e, proj, "weight")] = packed
                out[(layer, e, proj, "scale")] = scale
    return out


def _build(layout, redundant, ckpt, dtype):
    from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts

    torch.set_default_dtype(dtype)  # the layer's GEMM operators are chosen for the model dtype
    layers = [RoutedExperts(EXPERTS, HIDDEN, INTER, layout, redundant) for _ in range(LAYERS)]
    torch.set_default_dtype(torch.float32)
    for (layer, e, proj, kind), t in ckpt.items():
        layers[layer].load_expert(proj, kind, e, t)
    return layers


def _tokens(rank: int, step: int, layer: int, dtype):
    """Skewed routing: a few hot experts per layer (which ones changes at step 6)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * layer + rank)
    n = 5 + 3 * rank + step % 3  # ranks differ in token count: gathered rows are padded
    popularity = torch.tensor([0.45, 0.2, 0.1, 0.08, 0.07, 0.04, 0.03, 0.03])
    perm = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(layer + 7 * (step >= 6)))
    probs = torch.empty(EXPERTS).scatter_(0, perm, popularity)
    ids = torch.multinomial(probs.expand(n, -1), TOP_K, generator=g)
    x = torch.randn(n, HIDDEN, generator=g).to(dtype)
    weights = torch.rand(n, TOP_K, generator=g)
    return x, weights, ids


MODES = ("fp32", "bf16-bi")


def rank_main(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    reports = {mode: run_mode(rank, mode) for mode in MODES}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(reports, f)
    dist.destroy_process_group()


def run_mode(rank: int, mode: str) -> dict:
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if mode == "bf16-bi" else "0"  # read at layer build
    import vllm.distributed
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from deepinfer_vllm.model_executor.eplb import EplbSettings, ExpertBalancer
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    coord = Coordinator()
    vllm.distributed.get_dp_group = lambda: coord
    vllm.distributed.get_ep_group = lambda: coord
    dtype = torch.bfloat16 if mode == "bf16-bi" else torch.float32
    ckpt = _checkpoint(seed=3)
    layout = ParallelLayout(dp_size=2, dp_rank=rank, expert_parallel=True)
    base = _build(layout, None, ckpt, dtype)
    bal = _build(layout, REDUNDANT, ckpt, dtype)
    one = _build(ParallelLayout(), None, ckpt, dtype)

    class Model(MixtureOfExperts):
        def __init__(self, layers):
            self.moe_layers = layers
            self.num_moe_layers = len(layers)
            self.num_logical_experts = EXPERTS
            self.num_physical_experts = EXPERTS + REDUNDANT
            self.expert_weights = []

    settings = EplbSettings(WINDOW, INTERVAL, REDUNDANT, False, "deepinfer")
    balancer = ExpertBalancer(Model(bal), settings, coord)
    report = {
        "equal_base": [],
        "equal_one": [],
        "alone_equal": [],
        "imbalance": [],
        "maps": [],
        "slots_ok": [],
    }
    for step in range(STEPS):
        balancer.run_pending()  # as the model does at the start of its forward
        eq_base, eq_one, alone = True, True, True
        for layer in range(LAYERS):
            x, w, ids = _tokens(rank, step, layer, dtype)
            got = bal[layer](x, w, ids, LIMIT)
            eq_base &= torch.equal(got, base[layer](x, w, ids, LIMIT))
            eq_one &= torch.equal(got, one[layer](x, w, ids, LIMIT))
            if mode == "bf16-bi":  # the first token alone (both ranks) equals itself in the batch
                single = bal[layer](x[:1], w[:1], ids[:1], LIMIT)
                alone &= torch.equal(single, got[:1])
        # Received (token, expert) pairs per rank this step under the placement in use.
        counts = coord.all_reduce(balancer.load_pass.clone())
        per_rank = counts.view(LAYERS, 2, -1).sum(-1).double()
        report["imbalance"].append((per_rank.max(-1).values / per_rank.mean(-1)).mean().item())
        report["equal_base"].append(bool(eq_base))
        report["equal_one"].append(bool(eq_one))
        report["alone_equal"].append(bool(alone))
        balancer.step()
        if (step + 1) % INTERVAL == 0:
            balancer.run_pending()
            report["maps"].append(balancer.placement.phy_to_log.tolist())
            # Every local slot holds the bytes of the expert the map names (the one-rank copy's).
            ok = True
            for layer in range(LAYERS):
                lay = bal[layer]
                for j, e in enumerate(lay.physical_to_logical[lay.local.start : lay.local.stop].tolist()):
                    for name in ("w13", "w13_scale", "w2", "w2_scale"):
                        mine = getattr(lay, name)[j].view(torch.uint8)
                        ok &= torch.equal(mine, getattr(one[layer], name)[e].view(torch.uint8))
            report["slots_ok"].append(bool(ok))
    report["rebalances"] = balancer.rebalances
    report["moved_rebalances"] = balancer.moved_rebalances
    all_ok = torch.tensor([int(all(report["slots_ok"]))])
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    report["slots_ok_all_ranks"] = bool(all_ok.item())
    return report


def vllm_state(port: int) -> dict:
    """vLLM's ``EplbState`` on one CPU process (expert group of one): ``add_model`` hands its maps and
    counters to the layers, a forward counts into them, ``step`` records the window; its policy and
    ``rearrange_expert_weights_inplace`` (gloo communicator) then move the slots and
    ``_commit_eplb_maps`` swaps the maps. ``EplbState.rearrange`` itself is not called: it times
    itself with ``torch.Event``, which the CPU backend lacks (returned as ``rearrange_error``)."""
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.distributed.eplb.eplb_state import EplbState, _commit_eplb_maps
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.interfaces import MixtureOfExperts, is_mixture_of_experts

    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    os.environ["DEEPINFER_BATCH_INVARIANT"] = "0"
    par = ParallelConfig()
    config = VllmConfig(parallel_config=par)
    # Set after validation: vLLM's config check refuses enable_eplb on a CPU.
    par.enable_eplb = par.enable_expert_parallel = True
    par.eplb_config = EPLBConfig(
        window_size=300,
        step_interval=1000,
        num_redundant_experts=REDUNDANT,
        use_async=False,
        communicator="torch_gloo",
    )
    out = {}
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        ckpt = _checkpoint(seed=3)
        layers = _build(ParallelLayout(expert_parallel=True), REDUNDANT, ckpt, torch.float32)
        one = _build(ParallelLayout(), None, ckpt, torch.float32)

        class Model(MixtureOfExperts):
            def __init__(self):
                self.moe_layers = layers
                self.num_moe_layers = LAYERS
                self.num_expert_groups = self.num_shared_experts = 1
                self.num_logical_experts = self.num_routed_experts = EXPERTS
                self.num_physical_experts = self.num_local_physical_experts = EXPERTS + REDUNDANT
                self.num_redundant_experts = REDUNDANT
                self.expert_weights = []

        class ModelConfig:
            model = "tiny"

            def compute_hash(self):
                return "tiny"

        model = Model()
        out["is_mixture_of_experts"] = is_mixture_of_experts(model)
        state = EplbState(par, torch.device("cpu"))
        state.add_model(model, ModelConfig())
        ms = state.model_states["tiny"]
        out["views"] = all(
            lay.expert_load_view.data_ptr() == ms.expert_load_pass_buffer[i].data_ptr()
            and lay.logical_to_physical_map.data_ptr() == ms.logical_to_physical_map[i].data_ptr()
            for i, lay in enumerate(layers)
        )
        x, w, ids = _tokens(0, 0, 0, torch.float32)
        layers[0](x, w, ids, LIMIT)
        routed = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
        state.step()
        window = ms.expert_load_window.sum(0).long()
        loads = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64).scatter_add_(
            1, ms.physical_to_logical_map.long(), window
        )
        out["counted"] = loads[0].tolist() == routed.tolist() and int(loads[1].sum()) == 0
        new = state.policy.rebalance_experts(loads, EXPERTS + REDUNDANT, 1, 1, 1, ms.physical_to_logical_map)
        out["map_changed"] = not torch.equal(new, ms.physical_to_logical_map.cpu())
        rearrange_expert_weights_inplace(
            ms.physical_to_logical_map,
            new,
            model.expert_weights,
            ms.expert_buffer,
            get_ep_group().device_group,
            ms.communicator,
            False,
            None,
        )
        _commit_eplb_maps(ms, new)
        out["slots_ok"] = all(
            torch.equal(
                getattr(layers[i], name)[j].view(torch.uint8), getattr(one[i], name)[e].view(torch.uint8)
            )
            for i in range(LAYERS)
            for j, e in enumerate(new[i].tolist())
            for name in ("w13", "w13_scale", "w2", "w2_scale")
        )
        x, w, ids = _tokens(0, 1, 0, torch.float32)
        out["equal_one"] = torch.equal(layers[0](x, w, ids, LIMIT), one[0](x, w, ids, LIMIT))
        try:
            state.rearrange()
            out["rearrange_error"] = None
        except RuntimeError as e:
            out["rearrange_error"] = str(e)
    return out


if __name__ == "__main__":
    port, out_path = int(sys.argv[1]), sys.argv[2]
    mp.spawn(rank_main, args=(port, out_path), nprocs=2)
    with open(out_path) as f:
        reports = json.load(f)
    reports["vllm_state"] = vllm_state(port + 1)
    with open(out_path, "w") as f:
        json.dump(reports, f)
