"""The plugin's model class over N processes, data-parallel attention + expert parallelism, as
vLLM's workers build it, against the same requests on one process (issue 37).

Each rank is one process (one GPU on CUDA). It sets up vLLM's process groups the way a
data-parallel worker does: the ``VllmConfig`` says ``data_parallel_size=N``,
``data_parallel_rank=r`` and ``enable_expert_parallel``; the worker passes its own world size
(TP x PP = 1) and rank 0 to ``init_distributed_environment``, which (vLLM 0.32,
``parallel_state``) offsets the rank by the DP rank, takes ``world_size_across_dp`` as the world
and meets the other ranks at ``data_parallel_master_ip:port``; ``initialize_model_parallel(1, 1)``
then makes a TP group of one and DP and EP groups of N. The model is ``DeepseekV41ForCausalLM``
built through ``v41_harness.PagedHarness`` (its ``init_groups`` hook) from a checkpoint, so each
rank loads its ``n_routed_experts / N`` experts (and ``1 / N`` of the Engram rows) and every
MoE / Engram layer sends its tokens through ``TokenExchange`` (gather the DP rows, reduce over
the EP group, take the own rows back).

The requests (``plan``): each DP rank runs its own requests, a prefill then decode steps with
fixed next tokens (so a rank's inputs never depend on its logits, and the one-process run sees
the same tokens). Ranks differ in token count (rank 0 two requests, the others one); in the last
step the last rank is idle and runs vLLM's dummy batch (one token, no attention metadata), as an
idle DP engine does, so that its peers' collectives complete. The one-process run (``reference``:
every expert on one rank, no exchange) runs every rank's chunks of a step in one batch.

Numerics: in fp32 the model accumulates in fp64 and the exchange sums partial results in fp64,
rounded once after the reduction (``layers/parallel.py``), so the N-rank logits equal the
one-rank logits bit for bit. In bf16 the sums of the routed experts travel in fp32 (summed over
ranks, not in one rank's expert order) and the fp32 islands of a bf16 step round differently for
different row counts (the MoE sees every rank's rows, padded), which can flip an FP8/FP4 bin
downstream: agreement, not equality (``test_multi_rank_harness.py`` states the bounds).

Run on the CPU (gloo, one thread per process)::

    .venv/bin/python tests/model_executor/multi_rank_harness.py --model DIR --world 2 --out OUT

(``DIR``: ``python -m deepinfer_vllm.tools.make_checkpoint --preset tiny``; ``OUT`` gets
``{dtype}-rank{r}.pt``, ``{dtype}-reference.pt`` and ``summary.json``; ``python -m
tests.model_executor.multi_rank_harness`` from the repository root runs the same). Running it on
N GPUs with NCCL (one process per GPU, ``cuda:r``; the reference on ``cuda:0``), from the
repository root of the GPU host with the carried vLLM sources (``tests/gpu_model/run.sh``)::

    bash tests/gpu_model/run.sh --python tests/model_executor/multi_rank_harness.py \\
        --model DIR --world 8 --device cuda --out OUT

The launcher sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` (NVLink multicast off) before it spawns, so every child inherits
them. The tiny checkpoint has 8 routed experts, so ``--world`` is 2, 4 or 8 there. Not yet
written (issue 37's measurement): the decode step at B=64 per rank, 8K context, EP=2/4/8 with
Flash-shaped layers (``benchmarks/gpu_model.py``'s ``layer_config`` / ``fill_parameters`` at
``load_weights=False``, each rank holding its 384/N experts instead of ``emulate_expert_shard``),
timed eagerly and from a CUDA graph, with the exchange's share (the time of
``TokenExchange.gather`` / ``reduce`` under the profiler) against an NCCL all-gather +
all-reduce of the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # v41_harness, also in the spawned children

# NVLink multicast off in every process of a GPU run (set before the children are spawned).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = ("float32", "bfloat16")
DECODE_STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(world: int, seed: int = 0) -> list[list[list[tuple[str, list[int]]]]]:
    """``steps[s][r]``: rank ``r``'s chunks ``[(request id, new tokens)]`` at step ``s`` (``[]``:
    idle, a dummy batch). Step 0 prefills, then ``DECODE_STEPS`` decode steps with fixed tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = {r: ([23, 41] if r == 0 else [9 + 5 * r]) for r in range(world)}
    prompts = {
        f"r{r}q{i}": torch.randint(3, 120000, (n,), generator=g).tolist()
        for r in range(world)
        for i, n in enumerate(lengths[r])
    }
    steps = [[[(rid, p) for rid, p in prompts.items() if rid.startswith(f"r{r}q")] for r in range(world)]]
    for s in range(DECODE_STEPS):
        step = []
        for r in range(world):
            idle = world > 1 and r == world - 1 and s == DECODE_STEPS - 1
            rids = [] if idle else [rid for rid, _ in steps[0][r]]
            step.append([(rid, torch.randint(3, 120000, (1,), generator=g).tolist()) for rid in rids])
        steps.append(step)
    return steps


def _harness(model_dir: str, dtype: str, device: str, init_groups=None, **engine_args):
    from v41_harness import PagedHarness

    return PagedHarness(
        model_dir,
        dtype=dtype,
        device=device,
        num_blocks=64,
        max_model_len=256,
        init_groups=init_groups,
        **engine_args,
    )


def dummy_step(harness) -> None:
    """An idle DP rank's step: vLLM's dummy batch of one token, no attention metadata; the
    model still enters every MoE / Engram exchange of its peers."""
    from vllm.forward_context import set_forward_context

    zeros = torch.zeros(1, dtype=torch.int64, device=harness.device)
    with set_forward_context(None, harness.cfg, num_tokens=1):
        harness.model(zeros, zeros)


def rank_main(rank: int, world: int, port: int, model_dir: str, device_kind: str, out: str, dtypes) -> None:
    """One DP rank: vLLM's groups (once), then per dtype the model and every step of ``plan``;
    writes ``{dtype}-rank{rank}.pt`` (per step: logits ``[T_r, V]`` on the CPU, or None when idle)."""
    import faulthandler

    from vllm.distributed import parallel_state as ps

    # A rank stuck in a collective prints where it waits and exits (the launcher then fails).
    faulthandler.dump_traceback_later(float(os.environ.get("MULTI_RANK_WATCHDOG_S", "300")), exit=True)
    torch.set_num_threads(1)
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    backend = "nccl" if device_kind == "cuda" else "gloo"

    def init_groups(cfg) -> None:
        par = cfg.parallel_config
        par.data_parallel_rank = par.data_parallel_rank_local = rank
        if ps.model_parallel_is_initialized():  # the second dtype's model: same groups
            return
        par.data_parallel_master_ip = "127.0.0.1"
        par.data_parallel_master_port = port
        par._data_parallel_master_port_list = []  # ports the config drew for itself, per process
        # As a DP worker: its own world (TP x PP = 1) and rank; vLLM offsets by the DP rank.
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=rank, backend=backend)
        ps.initialize_model_parallel(1, 1)
        assert ps.get_dp_group().world_size == world and ps.get_ep_group().world_size == world
        assert ps.get_dp_group().rank_in_group == rank

    steps = plan(world)
    for dtype in dtypes:
        h = _harness(
            model_dir, dtype, device, init_groups, data_parallel_size=world, enable_expert_parallel=True
        )
        layout = h.model.layout
        assert layout.expert_parallel and layout.moe_size == world and layout.dp_rank == rank
        logits = []
        with torch.no_grad():
            for step in steps:
                if step[rank]:
                    logits.append(h.step(step[rank]).float().cpu())
                else:
                    dummy_step(h)
                    logits.append(None)
        experts = h.model.arch.n_routed_experts
        torch.save(
            {"logits": logits, "local_experts": list(layout.local_experts(experts)), "experts": experts},
            f"{out}/{dtype}-rank{rank}.pt",
        )
        del h
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def reference(model_dir: str, world: int, dtype: str, device: str) -> list[list[torch.Tensor | None]]:
    """The same steps on one process holding every expert: each step's chunks of all ranks in
    one batch; returns ``[step][rank]`` logits (None where the rank was idle)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count (bf16's fp32 islands depend on it)
    try:
        h = _harness(model_dir, dtype, device)
        out = []
        with torch.no_grad():
            for step in plan(world):
                chunks = [c for per_rank in step for c in per_rank]
                rows = h.step(chunks).float().cpu()
                per_rank, start = [], 0
                for r_chunks in step:
                    n = sum(len(t) for _, t in r_chunks)
                    per_rank.append(rows[start : start + n] if r_chunks else None)
                    start += n
                out.append(per_rank)
        return out
    finally:
        torch.set_num_threads(previous)


def compare(ranks: list[dict], ref: list[list]) -> dict:
    """N-rank logits against the one-process logits over every rank's rows of every step."""
    experts = ranks[0]["experts"]
    busy = [(r, s) for r, d in enumerate(ranks) for s, t in enumerate(d["logits"]) if t is not None]
    got = torch.cat([ranks[r]["logits"][s] for r, s in busy])
    want = torch.cat([ref[s][r] for r, s in busy])
    assert got.shape == want.shape, (got.shape, want.shape)
    idle = [
        [t is None for t in d["logits"]] == [ref[s][r] is None for s in range(len(ref))]
        for r, d in enumerate(ranks)
    ]
    return {
        "rows": got.shape[0],
        "bit_equal": bool(torch.equal(got, want)),
        "max_abs": (got - want).abs().max().item(),
        "max_ref": want.abs().max().item(),
        "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "min_cosine": torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1).min().item(),
        "idle_steps_match": all(idle),
        "experts_split": sorted(e for d in ranks for e in d["local_experts"]) == list(range(experts))
        and all(len(d["local_experts"]) == experts // len(ranks) for d in ranks),
    }


def run(model_dir: str, world: int, out: str, device: str = "cpu", dtypes=DTYPES) -> dict:
    """Spawn ``world`` ranks (both dtypes in one spawn), then the one-process reference; returns
    ``{dtype: compare(...)}`` and writes it to ``out/summary.json``."""
    import torch.multiprocessing as mp

    os.environ.update(NCCL_ENV)  # inherited by every child
    Path(out).mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(world, free_port(), model_dir, device, out, tuple(dtypes)), nprocs=world)
    summary = {}
    for dtype in dtypes:
        ranks = [torch.load(f"{out}/{dtype}-rank{r}.pt") for r in range(world)]
        ref = reference(model_dir, world, dtype, "cuda:0" if device == "cuda" else "cpu")
        torch.save(ref, f"{out}/{dtype}-reference.pt")
        summary[dtype] = compare(ranks, ref)
    with open(f"{out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (e.g. the tiny preset)")
    p.add_argument("--world", type=int, default=2, help="processes (DP = EP ranks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    summary = run(a.model, a.world, a.out, a.device, a.dtypes.split(","))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
