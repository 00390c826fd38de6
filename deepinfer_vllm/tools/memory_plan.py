"""``deepinfer-memory-plan``: what each rank holds for a V4.1 config, and the context that fits.

    deepinfer-memory-plan --config flash --dp 8 --ep 8 [--redundant-experts 8]
    deepinfer-memory-plan --config flash --tp 8 [--engram-host] [--hbm-gib 141]
    deepinfer-memory-plan --config DIR   (a checkpoint folder: config.json is enough)

For every rank the real model class is built on the meta device, under vLLM's
config and process-group sizes of that rank (the groups are stand-ins that
know sizes and ranks, nothing is communicated and no memory is allocated),
and its parameters are summed by component: routed experts, Engram tables,
dense (attention, shared experts, norms, mHC, routers, Engram projections),
embedding and head. DSpark and vision tensors are not held until a feature
runs them; their checkpoint totals are shown beside. KV bytes per token come
from the cache declarations the model registers with vLLM; the window caches
are per running request. The tokens of context that fit are

    (HBM x utilization - weights - reserve - requests x window KV) / global KV per token

``--ep`` follows vLLM: expert parallelism spans data_parallel x tensor_parallel
ranks (``--ep`` is 1, or ``tp * dp`` with ``enable_expert_parallel``).
``--redundant-experts N`` plans expert load balancing with N redundant
experts (vLLM's ``eplb_config.num_redundant_experts``): each rank then holds
``(n_routed_experts + N) / ep`` expert slots per layer, shown per rank.
``--engram-host`` keeps Engram rows in (pinned) host memory, as DeepInfer
does by default, and shows them in a host column instead of HBM.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_vllm.model_executor.resident_bytes import component_of

__all__ = ["RankPlan", "main", "plan"]

GIB = 1 << 30
HELD = ("experts", "engram", "dense", "embedding_head")


@dataclass
class RankPlan:
    rank: int
    tp_rank: int
    dp_rank: int
    weights: dict[str, int]  # resident bytes by component
    kv_per_token: dict[str, float]  # bytes per token by cache kind
    window_per_request: int  # bytes of window KV one running request keeps
    not_held: dict[str, int]  # checkpoint bytes of DSpark / vision (not held)
    expert_slots: int = 0  # routed-expert slots per layer on this rank (whole experts), 0 for slices


class _PlanGroup:
    """Stands in for a vLLM group coordinator while a model is built for planning."""

    def __init__(self, world_size: int, rank_in_group: int):
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.rank = rank_in_group
        self.ranks = list(range(world_size))

    def __getattr__(self, name: str):
        raise RuntimeError(f"memory planning builds models only; group.{name} is not available")


@contextlib.contextmanager
def _planning_groups(tp: int, tp_rank: int, dp: int, dp_rank: int) -> Iterator[None]:
    from vllm.distributed import parallel_state as ps

    saved = (ps._TP, ps._PP, ps._DP, ps._EP)
    ps._TP = _PlanGroup(tp, tp_rank)
    ps._PP = _PlanGroup(1, 0)
    ps._DP = _PlanGroup(dp, dp_rank)
    ps._EP = _PlanGroup(tp * dp, dp_rank * tp + tp_rank)
    try:
        yield
    finally:
        ps._TP, ps._PP, ps._DP, ps._EP = saved


def _config_dir(config: str, scratch: Path) -> Path:
    """A folder with the config.json of preset ``config``, or ``config`` itself."""
    from deepinfer_vllm.tools.make_checkpoint import write_config
    from deepinfer_vllm.tools.presets import PRESETS

    if config in PRESETS:
        return write_config(scratch / config, preset=config)
    path = Path(config)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"--config {config!r}: neither a preset {sorted(PRESETS)} nor a folder with config.json"
        )
    return path


def _vllm_config(
    model_dir: Path, tp: int, dp: int, ep: int, max_model_len: int | None, redundant_experts: int = 0
):
    import deepinfer_vllm
    from vllm.engine.arg_utils import EngineArgs

    deepinfer_vllm.register()
    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len)
    vc = args.create_engine_config()
    par = vc.parallel_config
    par.tensor_parallel_size = tp
    par.data_parallel_size = dp
    par.enable_expert_parallel = ep > 1
    if redundant_experts:
        # The plugin's spelling of vLLM's EPLB fields (model_executor.eplb).
        vc.additional_config = {
            "enable_eplb": True,
            "eplb_config": {"num_redundant_experts": redundant_experts},
        }
    return vc


def _not_held(arch) -> dict[str, int]:
    """Checkpoint bytes of the DSpark stages and the vision tower (whole model)."""
    from deepinfer_vllm.configs import checkpoint
    from deepinfer_vllm.model_executor.quantization import TORCH_DTYPES

    out = {"dspark": 0, "vision": 0}
    for name, spec in checkpoint.expected_tensors(arch).items():
        comp = component_of(name)
        if comp in out:
            out[comp] += TORCH_DTYPES[spec.dtype].itemsize * math.prod(spec.shape)
    return out


def plan(
    config: str,
    tp: int = 1,
    dp: int = 1,
    ep: int = 1,
    max_model_len: int | None = None,
    redundant_experts: int = 0,
) -> list[RankPlan]:
    """Build the model for every rank of the layout on the meta device and size it."""
    if redundant_experts < 0:
        raise ValueError(f"--redundant-experts {redundant_experts}: must be >= 0")
    if redundant_experts and ep == 1:
        raise ValueError("--redundant-experts needs expert parallelism (--ep = tp * dp > 1)")
    if ep not in (1, tp * dp):
        raise ValueError(
            f"--ep {ep}: vLLM's expert parallelism spans data_parallel x tensor_parallel = {tp * dp} "
            f"ranks (enable_expert_parallel); use --ep 1 or --ep {tp * dp}"
        )
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token
    from deepinfer_vllm.model_executor.models.deepseek_v41 import DeepseekV41ForCausalLM

    plans = []
    with tempfile.TemporaryDirectory() as scratch:
        vc = _vllm_config(_config_dir(config, Path(scratch)), tp, dp, ep, max_model_len, redundant_experts)
        block = vc.cache_config.block_size
        not_held = None
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                vc.compilation_config.static_forward_context = {}
                with (
                    _planning_groups(tp, tp_rank, dp, dp_rank),
                    set_current_vllm_config(vc),
                    set_default_torch_dtype(vc.model_config.dtype),
                    torch.device("meta"),
                ):
                    model = DeepseekV41ForCausalLM(vllm_config=vc)
                weights = dict.fromkeys(HELD, 0)
                for name, param in model.named_parameters():
                    weights[component_of(name)] += param.numel() * param.element_size()
                decls = [c.decl for c in model.cache_layers.values()]
                per_token = bytes_per_token(decls, block)
                # Sliding-window caches keep the blocks a window can span, per request.
                window = sum(
                    d.spec(block).page_size_bytes * -(-(d.sliding_window + block - 1) // block)
                    for d in decls
                    if d.sliding_window is not None
                )
                not_held = not_held or _not_held(model.arch)
                slots = len(model.layers[0].ffn.experts.local) if ep > 1 else 0
                plans.append(
                    RankPlan(
                        dp_rank * tp + tp_rank, tp_rank, dp_rank, weights, per_token, window, not_held, slots
                    )
                )
                del model
    return plans


def _gb(n: float) -> str:
    return f"{n / 1e9:8.2f}"


def format_plan(
    plans: list[RankPlan],
    hbm_gib: float,
    utilization: float,
    reserve_gib: float,
    requests: int,
    engram_host: bool,
) -> str:
    first = plans[0]
    lines = [
        "Weights per rank in GB (1e9 bytes), as held: experts packed E2M1 + UE8M0, dense FP8 + UE8M0 tiles, "
        "Engram E4M3 + UE8M0, embedding/head bf16",
        f"{'rank':>4} {'tp':>3} {'dp':>3} {'slots':>5} {'experts':>8} {'Engram':>8} {'dense':>8} "
        f"{'emb+head':>8} {'HBM wts':>8} {'host':>8} {'KV toks':>12}",
    ]
    kv_global = first.kv_per_token["global"]
    for p in plans:
        w = p.weights
        host = w["engram"] if engram_host else 0
        hbm = sum(w.values()) - host
        budget = hbm_gib * GIB * utilization - hbm - reserve_gib * GIB - requests * p.window_per_request
        tokens = max(0, int(budget // kv_global))
        lines.append(
            f"{p.rank:>4} {p.tp_rank:>3} {p.dp_rank:>3} {p.expert_slots or '-':>5} "
            f"{_gb(w['experts'])} {_gb(w['engram'])} {_gb(w['dense'])} "
            f"{_gb(w['embedding_head'])} {_gb(hbm)} {_gb(host)} {tokens:>12,}"
        )
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in first.kv_per_token.items())
    lines += [
        "slots: routed-expert slots per layer on the rank (whole experts; with --redundant-experts the "
        "redundant ones included; '-': every expert's slice)",
        f"KV bytes per token (every rank): {kinds}; window KV per running request "
        f"{first.window_per_request / 1e6:.2f} MB",
        f"KV toks: context tokens that fit per rank in {hbm_gib:g} GiB x {utilization:g} after weights, "
        f"{reserve_gib:g} GiB reserve and the window KV of {requests} running requests, at "
        f"{kv_global:.1f} B/token",
        "Not held until used (checkpoint bytes, whole model): "
        f"DSpark {_gb(first.not_held['dspark']).strip()} GB, "
        f"vision {_gb(first.not_held['vision']).strip()} GB",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer-memory-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="a preset (tiny, small, flash) or a folder with config.json"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--dp", type=int, default=1, help="data_parallel_size")
    parser.add_argument("--ep", type=int, default=1, help="1, or tp * dp with enable_expert_parallel")
    parser.add_argument(
        "--redundant-experts",
        type=int,
        default=0,
        help="expert load balancing's redundant experts (eplb_config num_redundant_experts)",
    )
    parser.add_argument("--engram-host", action="store_true", help="Engram rows in host memory, not HBM")
    parser.add_argument("--hbm-gib", type=float, default=141.0 * 1e9 / GIB, help="HBM per GPU (H200: 141 GB)")
    parser.add_argument("--utilization", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--reserve-gib", type=float, default=8.0, help="activations, workspace, CUDA context")
    parser.add_argument("--requests", type=int, default=256, help="running requests (window KV each)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the config's")
    args = parser.parse_args(argv)
    plans = plan(args.config, args.tp, args.dp, args.ep, args.max_model_len, args.redundant_experts)
    print(
        f"deepinfer-memory-plan --config {args.config} --tp {args.tp} --dp {args.dp} --ep {args.ep}"
        + (f" --redundant-experts {args.redundant_experts}" if args.redundant_experts else "")
        + (" --engram-host" if args.engram_host else "")
    )
    print(
        format_plan(plans, args.hbm_gib, args.utilization, args.reserve_gib, args.requests, args.engram_host)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
