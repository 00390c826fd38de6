"""``deepinfer-memory-plan``: what each rank holds for a V4.1 config, and the context that fits.

    deepinfer-memory-plan --config flash --dp 8 --ep 8 [--redundant-experts 8]
    deepinfer-memory-plan --config flash --tp 8 [--engram-config '{"cpu_offload": false}'] [--hbm-gib 141]
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
``--engram-config JSON`` is vLLM's ``engram_config`` (its field names and checks; vLLM's defaults
when left out: ``cpu_offload`` on, ``dp_shared_memory`` on with ``--dp`` > 1), which the plugin
follows on a GPU or NPU (``model_executor.engram_host``): with ``cpu_offload`` the Engram rows are
shown in the host column instead of HBM, and the lines under the table give the HBM they free per
rank and the host memory they need per rank and per host (``--ranks-per-host``; with
``dp_shared_memory`` one copy per host, shared by its data-parallel ranks). ``--engram-host`` is the
older spelling of ``--engram-config '{"cpu_offload": true, "dp_shared_memory": false}'``.

Cached prefix tokens (rank 0's budget above): with vLLM's SWA bounded replay
(default) a cached prefix keeps its global records and Engram ids only, and a
hit may end at any block boundary (it replays its last window). With window
KV in the prefix cache (``--no-swa-bounded-replay``) a hit also needs the
window pages before its end: kept for every cached block with dense retention
(``prefix_cache_retention_interval`` None), or, vLLM's default, one window per
prompt end or shared-prefix junction (``--prefix-len`` tokens between them),
hits then ending only there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
    prefix_len: int = 8192,
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
    lines += _cached_prefix_lines(first, hbm_gib, utilization, reserve_gib, requests, engram_host, prefix_len)
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


def cached_prefix_tokens(
    p: RankPlan, hbm_gib: float, utilization: float, reserve_gib: float, requests: int, engram_host: bool,
    prefix_len: int,
) -> dict[str, int]:
    """Prefix tokens rank ``p`` can keep cached after weights, reserve and the running requests'
    window KV: ``replay`` with window KV out of the prefix cache (global records + Engram ids per
    token), ``cached`` with every cached block keeping its window pages (dense retention),
    ``cached_ends`` with one window's blocks (a running request's) per ``prefix_len`` tokens
    (vLLM's sparse retention, hits only at those ends)."""
    w = p.weights
    hbm = sum(w.values()) - (w["engram"] if engram_host else 0)
    budget = hbm_gib * GIB * utilization - hbm - reserve_gib * GIB - requests * p.window_per_request
    kv = p.kv_per_token
    kept = kv["global"] + kv.get("tokens", 0.0)
    end_window = p.window_per_request / prefix_len
    return {
        "replay": max(0, int(budget // kept)),
        "cached": max(0, int(budget // (kept + kv.get("window", 0.0)))),
        "cached_ends": max(0, int(budget // (kept + end_window))),
    }


def _cached_prefix_lines(p: RankPlan, hbm_gib, utilization, reserve_gib, requests, engram_host, prefix_len):
    n = cached_prefix_tokens(p, hbm_gib, utilization, reserve_gib, requests, engram_host, prefix_len)
    kv = p.kv_per_token
    kept = kv["global"] + kv.get("tokens", 0.0)
    line = (
        f"Cached prefix tokens, rank {p.rank}: {n['replay']:,} with window KV out of the prefix cache "
        f"(vLLM's swa_bounded_replay, default: {kept:.1f} B/token, a hit replays its last window); "
        f"with window KV cached (--no-swa-bounded-replay): {n['cached']:,} with dense retention "
        f"({kept + kv.get('window', 0.0):.1f} B/token, hits at any block boundary), "
        f"{n['cached_ends']:,} with vLLM's default sparse retention of {prefix_len:,}-token prefixes "
        f"(hits only at their ends) ({n['replay'] / max(n['cached'], 1):.1f}x and "
        f"{n['replay'] / max(n['cached_ends'], 1):.2f}x)"
    )
    return [line]


def engram_config(config: dict | None, dp: int) -> dict:
    """The fields of vLLM's ``engram_config`` for ``--engram-config`` (vLLM's class checks the field
    names and resolves ``dp_shared_memory`` for ``dp`` data-parallel ranks, as vLLM does)."""
    from types import SimpleNamespace

    from vllm.config import EngramConfig

    from deepinfer_vllm.model_executor.engram_host import FIELDS

    cfg = EngramConfig(**(config or {}))
    parallel = SimpleNamespace(data_parallel_size=dp, enable_elastic_ep=False)
    cfg.resolve_dp_shared_memory(parallel)
    cfg.verify_parallel_config(parallel)
    return {name: getattr(cfg, name) for name in FIELDS}


def engram_lines(config: str, plans: list[RankPlan], settings: dict, ranks_per_host: int) -> list[str]:
    """Where the Engram rows go under ``settings`` (vLLM's engram_config): HBM they take or free per
    rank, host memory per rank and per host (``engram_host.host_plan``)."""
    from deepinfer_vllm.configs import V41Arch
    from deepinfer_vllm.model_executor.engram_host import host_plan

    with tempfile.TemporaryDirectory() as scratch:
        text = (_config_dir(config, Path(scratch)) / "config.json").read_text()
    arch = V41Arch.from_config(json.loads(text))
    shown = ", ".join(f"{k}={v}" for k, v in settings.items())
    tp = max(p.tp_rank for p in plans) + 1
    dp = max(p.dp_rank for p in plans) + 1
    rows_hbm = max(p.weights["engram"] for p in plans)
    if not arch.engram_layer_ids:
        return ["Engram: none in this config"]
    if not settings["cpu_offload"]:
        return [f"Engram rows in HBM ({shown}): {_gb(rows_hbm).strip()} GB per rank; no host memory"]
    shared = bool(settings["dp_shared_memory"]) and dp > 1
    host = host_plan(arch, tp, dp, ranks_per_host, shared)
    on_host = min(ranks_per_host, tp * dp)
    where = (
        f"one copy per host shared by its data-parallel ranks (rows split over TP only), each rank "
        f"mapping {_gb(host['mapped_per_rank']).strip()} GB of it"
        if shared
        else f"{_gb(host['per_rank']).strip()} GB per rank in its own memory"
    )
    return [
        (
            f"Engram rows in host memory ({shown}; on a GPU or NPU, on CPU they are host memory anyway): "
            f"HBM freed per rank {_gb(rows_hbm).strip()} GB; host memory: {where}; "
            f"{_gb(host['per_host']).strip()} GB per host of {on_host} ranks"
        )
    ]


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
    parser.add_argument(
        "--engram-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="vLLM's engram_config, e.g. '{\"cpu_offload\": false}' (default: vLLM's defaults)",
    )
    parser.add_argument("--engram-host", action="store_true", help=argparse.SUPPRESS)  # older spelling
    parser.add_argument(
        "--ranks-per-host", type=int, default=8, help="GPUs (ranks) per host, for host memory per host"
    )
    parser.add_argument("--hbm-gib", type=float, default=141.0 * 1e9 / GIB, help="HBM per GPU (H200: 141 GB)")
    parser.add_argument("--utilization", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--reserve-gib", type=float, default=8.0, help="activations, workspace, CUDA context")
    parser.add_argument("--requests", type=int, default=256, help="running requests (window KV each)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the config's")
    parser.add_argument(
        "--prefix-len", type=int, default=8192, help="cached prefix length for the prefix-end bound"
    )
    args = parser.parse_args(argv)
    if args.engram_host and args.engram_config is None:
        args.engram_config = {"cpu_offload": True, "dp_shared_memory": False}
    engram = engram_config(args.engram_config, args.dp)
    plans = plan(args.config, args.tp, args.dp, args.ep, args.max_model_len, args.redundant_experts)
    print(
        f"deepinfer-memory-plan --config {args.config} --tp {args.tp} --dp {args.dp} --ep {args.ep}"
        + (f" --redundant-experts {args.redundant_experts}" if args.redundant_experts else "")
        + (f" --engram-config '{json.dumps(args.engram_config)}'" if args.engram_config is not None else "")
    )
    print(
        format_plan(
            plans, args.hbm_gib, args.utilization, args.reserve_gib, args.requests, engram["cpu_offload"],
            args.prefix_len,
        )
    )
    print("\n".join(engram_lines(args.config, plans, engram, args.ranks_per_host)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
