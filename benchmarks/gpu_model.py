"""One Flash-shaped V4.1 layer through the model class on the GPU: decode and prefill,
eager and replayed from a CUDA graph.

The model is the plugin's class with one backbone layer of the release's dimensions (a
"full" CSA2 layer: ratio-2 compressed KV and index source, top-512 sparse attention over
the 128-token window and the selected entries, MoE) and this rank's expert shard at EP=8
(48 of 384 routed experts; data-parallel attention, as a DP=8 + EP=8 deployment runs it).
Weights are filled in place with values of their released formats (no checkpoint file:
the shard alone is 0.85 GB of packed E2M1); caches hold zero records, and timing does not
depend on their values. Without Engram, DSpark and vision. Embedding and head are outside
the timed forward except the embedding lookup and final norm (the head's GEMM is vLLM's
sampler's, not the layer's).

Printed per case: time, bytes the step must read (the layer's weights, the experts its
tokens route to on this rank, window + selected compressed records + visible index keys),
FLOPs, the ratio of time to the bytes' copy-bandwidth roofline, and FLOP/s against the
fp8 matmul rate measured in the same run. Goal (issue 22): graphed decode at batch 64
within 2x of its roofline.

Run on the GPU host through the carried vLLM sources:
``bash tests/gpu_model/run.sh --python benchmarks/gpu_model.py`` (``--quick``: batch 1 and
64 at 8K only). ``--dry-run`` runs the same code on the CPU at tiny dimensions (no timings
worth reading; it checks the benchmark itself).

``--engram`` (issue 36) runs instead the decode cases of an Engram layer with its rows in device
memory and in host memory (vLLM's ``engram_config`` ``cpu_offload``; on CUDA the rows are read
through a device view of registered host memory, ``model_executor.engram_host``), graphed, and prints
the two times and their ratio. Layer 0 cannot hold Engram, so the model is two layers: a window-only
layer, then the full CSA2 layer above with Engram (``engram_layer_config``). Its table has the rows of
one rank's shard of a Flash table at EP=8 (``engram_vocab_size / EP``: about 48 M rows, 12.7 GB), held
whole by this rank, so every lookup of its tokens is served from it (as from a host copy shared by
the data-parallel ranks); ``--dry-run --engram`` runs the same code on the CPU (the host path
through the same gather, the CPU standing in for the device).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # config classes only (see tests/gpu_model)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "model_executor"))

import torch  # noqa: E402

EP = 8  # expert-parallel ranks emulated: this rank holds n_routed_experts / EP experts
DECODE = [(1, 8192), (64, 8192), (256, 8192), (1, 65536), (64, 65536), (256, 65536)]
QUICK = [(1, 8192), (64, 8192)]
PREFILL_TOKENS = 8192
E8M0_SCALE = 121  # 2^-6: weights of random e4m3 / e2m1 codes come out at ~0.02


def layer_config(preset: str) -> dict:
    """The preset's config cut to one full CSA2 layer (ratio 2, KV, index source)."""
    from deepinfer_vllm.tools.presets import get_preset

    cfg = get_preset(preset)
    t = cfg["text_config"]
    t.update(
        num_hidden_layers=1,
        compress_ratios=[2],
        kv_source_layer_ids=[0],
        index_source_layer_ids=[0],
        candidate_source_layer_id=-1,
        engram_layer_ids=[],
        engram_num_embeddings=[],
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
    )
    cfg.pop("vision_config", None)
    return cfg


def fill_parameters(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter set to finite values of its stored format."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        d = p.data
        if ".engram.embed." in name:
            continue  # fill_engram_rows: the rows may be in host memory, and are many
        if d.dtype == torch.float8_e8m0fnu:
            d.view(torch.uint8).fill_(E8M0_SCALE)
        elif d.dtype == torch.float8_e4m3fn:
            d.copy_(torch.randn(d.shape, generator=g, device=d.device).to(torch.float8_e4m3fn))
        elif d.dtype == torch.int8:  # packed E2M1: every byte is two valid codes
            d.copy_(torch.randint(-128, 128, d.shape, generator=g, device=d.device, dtype=torch.int8))
        elif "norm" in name:
            d.fill_(1.0)
        elif name.endswith("bias") or "attn_sink" in name:
            d.zero_()
        else:
            d.copy_(torch.randn(d.shape, generator=g, device=d.device) * 0.02)


def engram_layer_config(preset: str) -> dict:
    """Two layers: a window-only layer (layer 0 cannot hold Engram), then the full CSA2 layer of
    ``layer_config`` with an Engram table of one EP rank's share of the preset's table rows."""
    from deepinfer_vllm.ops.engram import engram_primes

    cfg = layer_config(preset)
    t = cfg["text_config"]
    full = get_preset_text(preset)
    vocab = max(full["engram_vocab_size"] // EP, 2)
    primes = engram_primes([1], full["engram_max_ngram_size"], full["engram_n_heads"], vocab)
    t.update(
        num_hidden_layers=2,
        compress_ratios=[0, 2],
        kv_source_layer_ids=[1],
        index_source_layer_ids=[1],
        engram_layer_ids=[1],
        engram_vocab_size=vocab,
        engram_num_embeddings=[sum(sum(order) for order in primes[1])],
        engram_compressed_vocab_size=full["engram_compressed_vocab_size"] or full["vocab_size"],
    )
    return cfg


def get_preset_text(preset: str) -> dict:
    from deepinfer_vllm.tools.presets import get_preset

    return get_preset(preset)["text_config"]


def whole_engram_tables() -> None:
    """This rank holds its Engram tables whole and serves every lookup of its tokens (the table is
    already a shard's size): no row is another rank's."""
    from deepinfer_vllm.model_executor.layers import v41_engram
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    init = v41_engram.EngramTable.__init__

    def whole(self, num_rows, dim, layout, placement=None, tag="table"):
        init(self, num_rows, dim, ParallelLayout(), placement, tag)

    v41_engram.EngramTable.__init__ = whole


def fill_engram_rows(model: torch.nn.Module, seed: int = 0) -> None:
    """Engram rows set to random E4M3 values with scale 2^-6 (in blocks of rows, on the device where
    there is one, then copied to wherever the rows live); the tables' token map set (nothing loads a
    tokenizer here)."""
    arch = model.arch
    fill_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator(device=fill_on).manual_seed(seed)
    for layer in model.layers:
        if layer.engram is None:
            continue
        table = layer.engram.embed
        table.scale.data.view(torch.uint8).fill_(E8M0_SCALE)
        rows = table.weight.data
        for start in range(0, rows.shape[0], 1 << 20):
            part = rows[start : start + (1 << 20)]
            values = torch.randn(part.shape, generator=g, device=fill_on).to(torch.float8_e4m3fn)
            part.copy_(values)
    old2new = torch.arange(arch.vocab_size) % arch.engram_compressed_vocab_size
    model.engram_tables.set_vocab(old2new)


def make_harness(model_dir, device, block, num_blocks, max_len, cases, prefill, **kwargs):
    """The paged harness of one benchmark model: bf16, random weights (filled by the caller), room
    for the largest decode batch of ``cases`` and a ``prefill``-token step; ``kwargs`` go to it."""
    from v41_harness import PagedHarness

    batch = max(b for b, _ in cases)
    return PagedHarness(
        str(model_dir),
        dtype="bfloat16",
        device=str(device),
        block_size=block,
        num_blocks=num_blocks,
        max_model_len=max_len,
        load_weights=False,
        ring_blocks=batch + 8,
        max_num_seqs=batch,
        max_num_batched_tokens=max(prefill, batch),
        **kwargs,
    )


def engram_main(args, device: torch.device, cases: list[tuple[int, int]]) -> None:
    """Decode steps of the Engram model with its rows in device memory and in host memory."""
    from deepinfer_vllm.tools.make_checkpoint import write_config

    block = 16
    max_len = max(ctx for _, ctx in cases) + block
    need_blocks = max(b * -(-(ctx + 1) // block) for b, ctx in cases) + 8
    emulate_expert_shard()
    whole_engram_tables()
    if device.type == "cpu":  # the CPU stands in for a device: its platform declares the device view
        import vllm.platforms

        type(vllm.platforms.current_platform).engram_host_transfer = "uva"
    os.environ.setdefault("DEEPINFER_ATTENTION_KERNELS", "torch" if args.dry_run else "triton")
    model_dir = write_config(
        tempfile.mkdtemp(prefix="gpu_model_engram_"),
        config=engram_layer_config("tiny" if args.dry_run else "flash"),
    )
    times: dict[tuple[str, int, int], float] = {}
    for where in ("device", "host"):
        harness = make_harness(
            model_dir, device, block, need_blocks, max_len, cases, 0, engram_config={"cpu_offload": where == "host"}
        )
        model, arch = harness.model, harness.model.arch
        assert model.engram_placement.host == (where == "host"), model.engram_placement.note
        fill_parameters(model)
        fill_engram_rows(model)
        table = model.layers[1].engram.embed
        row_bytes = table.weight.shape[1] + table.scale.shape[1]
        if where == "device":
            print(
                f"Engram table: {table.weight.shape[0]:,} rows x {row_bytes} B = "
                f"{table.weight.shape[0] * row_bytes / 1e9:.2f} GB, {arch.engram_n_columns} rows per token"
            )
        print(f"rows in {where} memory: {model.engram_placement.note}")
        for n_case, (batch, ctx) in enumerate(cases):
            harness.reset()
            rids = [f"e{n_case}_{i}" for i in range(batch)]
            for rid in rids:
                harness.add_context(rid, ctx)
            step = [(rid, [token(i, arch)]) for i, rid in enumerate(rids)]
            ids, positions, metadata = harness.prepare(step, table_width=-(-max_len // block))
            for meta in metadata.values():
                meta.max_seq_len = harness.cfg.model_config.max_model_len
            forward = model_forward(model, harness, ids, positions, metadata)
            forward()
            run = graphed(forward) if device.type == "cuda" else forward
            times[(where, batch, ctx)] = timed(run, 5 if args.dry_run else 50, device)
        del harness, model, table
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{'case':24s} {'device us':>10s} {'host us':>10s} {'host/dev':>9s} {'rows KB':>8s} "
        f"{'at 50 GB/s us':>14s}"
    )
    cols = arch.engram_n_columns
    for batch, ctx in cases:
        dev, host = times[("device", batch, ctx)], times[("host", batch, ctx)]
        moved = batch * cols * row_bytes
        print(
            f"{f'decode B={batch} ctx={ctx // 1024}K':24s} {dev * 1e6:10.1f} {host * 1e6:10.1f} "
            f"{host / dev:9.3f} {moved / 1e3:8.1f} {moved / 50e9 * 1e6:14.2f}"
        )


def emulate_expert_shard() -> None:
    """This process as rank 0 of EP data-parallel ranks: experts and tokens split as
    ``ParallelLayout`` does; the one-process groups make the collectives identities."""
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout

    ParallelLayout.from_vllm = classmethod(lambda cls, vllm_config: cls(dp_size=EP, expert_parallel=True))


def layer_bytes(layer, experts) -> tuple[int, int, int]:
    """(bytes of ``layer`` without its routed ``experts``, bytes of one routed expert, its elements)."""
    routed = {id(p) for p in experts.parameters()}
    dense = sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in routed)
    n_local = experts.w13.shape[0]
    per_expert = sum(p.numel() * p.element_size() for p in experts.parameters()) // n_local
    per_expert_elems = 2 * (experts.w13[0].numel() + experts.w2[0].numel())  # packed: 2 per byte
    return dense, per_expert, per_expert_elems


class RoutingProbe:
    """Records the expert ids the layer's MoE routes to (for the bytes and FLOPs)."""

    def __init__(self, experts):
        self.experts, self.ids = experts, None
        plain = experts.partial

        def partial(x, weights, ids, limit, *args, **kwargs):
            self.ids = ids.detach().clone()
            return plain(x, weights, ids, limit, *args, **kwargs)

        experts.partial = partial

    def local(self) -> tuple[int, int]:
        """(distinct local experts touched, local (token, expert) pairs)."""
        ids = self.ids.reshape(-1)
        lo, hi = self.experts.local.start, self.experts.local.stop
        mine = ids[(ids >= lo) & (ids < hi)]
        return int(torch.unique(mine).numel()), int(mine.numel())


def token(i: int, arch) -> int:
    """The ``i``-th of a spread of token ids (identical tokens would all route to the same experts)."""
    return (17 + 7919 * i) % arch.vocab_size


def step_cost(
    arch, dense_bytes, expert_bytes, expert_elems, touched, pairs, tokens, ctx
) -> tuple[float, float]:
    """(bytes read, FLOPs) of one step of ``tokens`` tokens each seeing ``ctx`` positions."""
    visible = ctx // 2
    selected = min(arch.index_topk, visible)
    kv = tokens * (arch.sliding_window * 528 + selected * 288 + visible * 68)
    bytes_read = dense_bytes + touched * expert_bytes + kv
    dense_elems = dense_bytes  # FP8: one byte per element (bf16 / fp32 islands are small)
    flops = 2.0 * tokens * dense_elems + 2.0 * pairs * expert_elems
    flops += 2.0 * tokens * arch.index_n_heads * arch.index_head_dim * visible
    flops += 4.0 * tokens * arch.num_heads * arch.head_dim * (arch.sliding_window + selected)
    return float(bytes_read), flops


def model_forward(model, harness, ids, positions, metadata):
    """The model's forward (hidden states, no head) on prepared step inputs."""
    from vllm.forward_context import set_forward_context

    def forward():
        with set_forward_context(metadata, harness.cfg):
            return model(ids, positions)

    return forward


def timed(fn, reps: int, device) -> float:
    """Median seconds of ``fn`` (events on CUDA, wall clock on the CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_table(launches, steps: int, rows: int = 30) -> list[str]:
    """The ``--profile`` table of the device kernels ``launches`` (``(name, start_us, end_us)`` of ``steps``
    steps): per kernel name its own time, the part of its launches' intervals that no earlier-starting
    launch already covers, and its span (the intervals as the profiler reports them). With PDL a kernel's
    programs start while its predecessor's last wave runs and wait there (``ops/triton/pdl.py``), so the
    span of a kernel after a long one includes that wait: the spans add up to more than the device was
    busy, and a short kernel after a GEMM reads as expensive. Own times add up to the busy time (the
    union of the intervals); the rows are sorted by own time."""
    kernels: dict[str, list[float]] = {}
    covered = float("-inf")  # the end of the union of the intervals of the launches started so far
    busy = 0.0
    for name, start, end in sorted(launches, key=lambda launch: (launch[1], launch[2])):
        own = max(0.0, end - max(start, covered))
        covered = max(covered, end)
        busy += own
        k = kernels.setdefault(name[:70], [0.0, 0.0, 0])
        k[0] += own
        k[1] += end - start
        k[2] += 1
    span = sum(k[1] for k in kernels.values())
    lines = [
        f"device kernels per step: {len(launches) / steps:.0f}, busy {busy / steps:.1f} us/step "
        f"(spans {span / steps:.1f}); per kernel: own us/step, span us/step, calls"
    ]
    for name, (own, spans, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"  {name:70s} {own / steps:8.1f} {spans / steps:8.1f} us/step {calls / steps:6.0f} calls")
    return lines


def profile(fn, device, steps: int = 3, rows: int = 30) -> None:
    """The kernels (operators on the CPU) of ``steps`` calls of ``fn``, by total device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type != "cuda":
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
        )
        return
    launches = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("part:")
    ]
    for line in kernel_table(launches, steps, rows):
        print(line)
    parts: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():  # a part's range appears on the host and on the device (the smaller)
        if e.key.startswith("part:"):
            t, c = parts.get(e.key, (float("inf"), 0))
            parts[e.key] = (min(t, e.device_time_total), max(c, e.count))
    for key, (t, c) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:48s} {t / steps:9.1f} us/step  ({c // steps} calls)")


def sources(fn, steps: int = 3, rows: int = 70) -> None:
    """The operators that launch the device kernels of ``steps`` calls of ``fn``, by the device time of the
    kernels each launches itself, with the plugin's frames of the Python stack that called it."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # without the verbose config this torch keeps no Python frames on the operators
    verbose = _ExperimentalConfig(verbose=True)
    with torch_profile(activities=activities, with_stack=True, experimental_config=verbose) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    items = [
        e
        for e in prof.key_averages(group_by_stack_n=12)
        if e.self_device_time_total > 0 and e.device_type != torch.autograd.DeviceType.CUDA
    ]
    launches = sum(e.count for e in items)
    print(f"operators launching kernels: {launches / steps:.0f} calls per step")
    for e in sorted(items, key=lambda e: -e.self_device_time_total)[:rows]:
        frames = [f for f in (e.stack or []) if "deepinfer_vllm" in f or "benchmarks" in f][:3]
        where = " < ".join(f.split("deepinfer_vllm/")[-1] for f in frames)
        print(f"  {e.key[:34]:34s} {e.self_device_time_total / steps:7.1f} us {e.count / steps:4.0f}x  {where}")


ANNOTATED = {
    "deepinfer_vllm.model_executor.models.deepseek_v41": ("collapse_norm",),
    "deepinfer_vllm.model_executor.layers.v41_mhc:HyperConnection": ("mix", "expand"),
    "deepinfer_vllm.model_executor.layers.v41_attention:V41Attention": (
        "forward",
        "write_compressed",
        "_select",
        "_attend",
        "_grouped_wo_a",
    ),
    "deepinfer_vllm.model_executor.layers.v41_moe:V41MoE": ("forward",),
    "deepinfer_vllm.model_executor.layers.v41_moe:Gate": ("forward",),
    "deepinfer_vllm.model_executor.layers.v41_moe:SharedExpert": ("forward",),
    "deepinfer_vllm.model_executor.layers.v41_moe:RoutedExperts": ("_partial_grouped", "combine"),
}


def host_side(fn, rows: int = 8, functions: int = 25) -> None:
    """The step's host side: time to enqueue it (no synchronisation after the call) against time to
    finish it, the calls in it that synchronise with the device (``set_sync_debug_mode``), by our
    innermost frame, and the Python functions taking its host time (``cProfile``, by own time;
    the profiler slows every call, so read shares, not times). An eager step whose enqueue time
    nears its finish time, or that waits for the device midway, is timed by the host, not by its
    kernels."""
    import collections
    import cProfile
    import io
    import pstats
    import traceback
    import warnings

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if "deepinfer_vllm" in f.filename]
        sites[f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(
        f"host: {(t1 - t0) * 1e6:.0f} us to enqueue the step, {(t2 - t0) * 1e6:.0f} us to finish it; "
        f"{sum(sites.values())} synchronising calls"
    )
    for where, n in sites.most_common(rows):
        print(f"  {n:4d}  {where}")
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(functions)
    stats.sort_stats("cumulative").print_stats(functions)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


def annotate_parts() -> None:
    """Wrap the layer's parts (``ANNOTATED``) in profiler ranges, for ``--profile``'s by-part table."""
    import functools
    import importlib

    for target, names in ANNOTATED.items():
        module_name, _, cls_name = target.partition(":")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, cls_name) if cls_name else owner
        for name in names:
            fn = getattr(owner, name)
            label = f"part:{cls_name or 'block'}.{name}"

            def wrapped(*a, _fn=fn, _label=label, **k):
                with torch.profiler.record_function(_label):
                    return _fn(*a, **k)

            setattr(owner, name, functools.wraps(fn)(wrapped))


def graphed(forward) -> callable:
    """``forward`` captured once (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny dimensions on the CPU")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the kernels of each case's eager step by device time",
    )
    parser.add_argument(
        "--sources",
        action="store_true",
        help="also print, for each case's eager step, the operators launching its kernels and where they are called",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="also print, for each case's eager step, host enqueue time, synchronising calls, cProfile",
    )
    parser.add_argument(
        "--cases",
        help="decode cases as BATCHxCONTEXT, comma-separated (e.g. 1x8192,256x8192); default QUICK or DECODE",
    )
    parser.add_argument(
        "--engram",
        action="store_true",
        help="only the Engram layer's decode, rows in device memory vs host memory (issue 36)",
    )
    parser.add_argument(
        "--wide-baseline",
        action="store_true",
        help="also time each graphed case without the wide dense GEMM kernel (ops/triton/fp8_gemm_wide_gluon.py)",
    )
    parser.add_argument(
        "--wide-rows",
        metavar="LO,HI",
        help="also time each graphed case with the wide dense GEMM kernel for LO <= rows < HI (fp8_gemm.WIDE_ROWS)",
    )
    parser.add_argument(
        "--ws-baseline",
        action="store_true",
        help="also time each graphed case without the warp-specialised kernels: the routed-expert GEMM's cp.async "
        "kernel (ops/triton/moe_gemm_gluon.py, WS_MAX_ROWS = 0) and the dense decode kernel whose threads copy "
        "(ops/triton/fp8_gemm_gluon.py, WARP_SPECIALIZED = False)",
    )
    parser.add_argument(
        "--stored-baseline",
        action="store_true",
        help="also time each graphed case with the fp32-weight stored GEMMs on 8 warps for 64 weight rows (two MMA "
        "layouts for the three dots: the configuration before the fifteenth session; ops/triton/stored_gemm.py)",
    )
    parser.add_argument(
        "--pdl-baseline",
        action="store_true",
        help="also time each graphed case with programmatic dependent launch off (ops/triton/pdl.py)",
    )
    args = parser.parse_args()
    if args.engram:
        device = torch.device("cpu" if args.dry_run else "cuda")
        engram_main(args, device, [(2, 256)] if args.dry_run else (QUICK if args.quick else DECODE))
        return
    from deepinfer_vllm.tools.make_checkpoint import write_config

    device = torch.device("cpu" if args.dry_run else "cuda")
    cases = [(2, 256)] if args.dry_run else (QUICK if args.quick else DECODE)
    if args.cases:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    prefill = 64 if args.dry_run else PREFILL_TOKENS
    block = 16  # vLLM's CPU platform classes (which build the config here) force 16 for MLA
    max_len = max(ctx for _, ctx in cases) + prefill + block
    need_blocks = max(max(b * -(-(ctx + 1) // block) for b, ctx in cases), -(-prefill // block)) + 8
    emulate_expert_shard()
    if args.profile:
        annotate_parts()
    os.environ.setdefault("DEEPINFER_ATTENTION_KERNELS", "torch" if args.dry_run else "triton")
    model_dir = write_config(
        tempfile.mkdtemp(prefix="gpu_model_"), config=layer_config("tiny" if args.dry_run else "flash")
    )
    harness = make_harness(model_dir, device, block, need_blocks, max_len, cases, prefill)
    model, arch = harness.model, harness.model.arch
    fill_parameters(model)
    experts = model.layers[0].ffn.experts
    dense, per_expert, per_expert_elems = layer_bytes(model.layers[0], experts)
    probe = RoutingProbe(experts)
    if device.type == "cuda":
        from benchmarks.gpu.common import measure_ceilings

        c = measure_ceilings()
        copy_bw, fp8_rate = c.copy_bytes_per_s, c.fp8_flops_per_s
        print(
            f"device: {torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.2f} TB/s, "
            f"fp8 {fp8_rate / 1e12:.0f} TFLOP/s"
        )
    else:
        copy_bw, fp8_rate = 1e11, 1e12  # placeholders: a dry run checks the code, not the speed
    print(
        f"layer: {dense / 1e6:.1f} MB without routed experts; {len(experts.local)} local experts of "
        f"{arch.n_routed_experts} ({per_expert / 1e6:.2f} MB each)"
    )
    print(
        f"{'case':28s} {'mode':7s} {'us':>9s} {'MB read':>9s} {'roofline x':>10s} "
        f"{'TFLOP/s':>8s} {'% fp8':>6s}"
    )

    def graphed_rows(case, forward, reps, nbytes, flops):
        """The graphed step; with ``--pdl-baseline`` also captured and timed without PDL, with ``--wide-baseline``
        without the wide dense GEMM kernel (``fp8_gemm.WIDE_ROWS`` empty), with ``--ws-baseline`` with the expert
        GEMM's cp.async kernel and the dense decode kernel whose threads copy, with ``--stored-baseline`` with the
        fp32-weight stored GEMMs on 8 warps, with ``--wide-rows`` with its rows window, in the same run."""
        from deepinfer_vllm.ops.triton import fp8_gemm, fp8_gemm_gluon, moe_gemm_gluon, pdl, stored_gemm

        wide_rows, ws_rows = fp8_gemm.WIDE_ROWS, moe_gemm_gluon.WS_MAX_ROWS
        dense_ws, stored_cfg = fp8_gemm_gluon.WARP_SPECIALIZED, stored_gemm.stored_config

        def stored_8_warps(m, n, k, w_fp32, sms=132):
            cfg = stored_cfg(m, n, k, w_fp32, sms)
            return dict(cfg, num_warps=8) if w_fp32 and not cfg.get("GEMV") else cfg

        base = (True, wide_rows, ws_rows, dense_ws, stored_cfg)
        modes = [("graphed", *base)]
        modes += [("no PDL", False, *base[1:])] if args.pdl_baseline else []
        modes += [("no wide", True, (0, 0), *base[2:])] if args.wide_baseline else []
        modes += [("no WS", True, wide_rows, 0, False, stored_cfg)] if args.ws_baseline else []
        modes += [("st 8w", *base[:-1], stored_8_warps)] if args.stored_baseline else []
        if args.wide_rows:
            lo, hi = (int(v) for v in args.wide_rows.split(","))
            modes += [(f"w{lo}-{hi - 1}", True, (lo, hi), *base[2:])]

        def switch(enabled, rows, ws, dws, stored):
            pdl.ENABLED, fp8_gemm.WIDE_ROWS, moe_gemm_gluon.WS_MAX_ROWS = enabled, rows, ws
            fp8_gemm_gluon.WARP_SPECIALIZED, stored_gemm.stored_config = dws, stored

        for mode, *setting in modes:
            switch(*setting)
            try:
                replay = graphed(forward)  # (its warm-up compiles this mode's kernels outside the capture)
                report(case, mode, timed(replay, reps, device), nbytes, flops)
            finally:
                switch(*base)
            del replay
            torch.cuda.empty_cache()

    def report(case, mode, seconds, nbytes, flops):
        roof = nbytes / copy_bw
        print(
            f"{case:28s} {mode:7s} {seconds * 1e6:9.1f} {nbytes / 1e6:9.1f} {seconds / roof:10.2f} "
            f"{flops / seconds / 1e12:8.1f} {100 * flops / seconds / fp8_rate:5.1f}%"
        )

    n_case = 0
    for batch, ctx in cases:
        harness.reset()
        rids = [f"c{n_case}_{i}" for i in range(batch)]
        n_case += 1
        for rid in rids:  # a context of zero records: the step reads every page it would
            harness.add_context(rid, ctx)
        width = -(-max_len // block)
        step = [(rid, [token(i, arch)]) for i, rid in enumerate(rids)]  # distinct tokens: routing spreads
        ids, positions, metadata = harness.prepare(step, table_width=width)
        for meta in metadata.values():  # the bound a captured step uses (as vLLM's builder gives it)
            meta.max_seq_len = harness.cfg.model_config.max_model_len

        forward = model_forward(model, harness, ids, positions, metadata)
        forward()
        touched, pairs = probe.local()
        nbytes, flops = step_cost(arch, dense, per_expert, per_expert_elems, touched, pairs, batch, ctx)
        name = f"decode B={batch} ctx={ctx // 1024}K"
        report(name, "eager", timed(forward, 5 if args.dry_run else 20, device), nbytes, flops)
        if args.profile:
            profile(forward, device)
        if args.host and device.type == "cuda":
            host_side(forward)
        if args.sources:
            sources(forward)
        if device.type == "cuda":
            graphed_rows(name, forward, 50, nbytes, flops)
    harness.reset()
    prompt = [token(i, arch) for i in range(prefill)]
    ids, positions, metadata = harness.prepare([("prefill", prompt)])

    prefill_forward = model_forward(model, harness, ids, positions, metadata)
    prefill_forward()
    touched, pairs = probe.local()
    nbytes, flops = step_cost(arch, dense, per_expert, per_expert_elems, touched, pairs, prefill, prefill)
    report(f"prefill {prefill} tokens", "eager", timed(prefill_forward, 3, device), nbytes, flops)
    if device.type == "cuda":  # the step makes no host synchronisation, so it can be captured too
        graphed_rows(f"prefill {prefill} tokens", prefill_forward, 5, nbytes, flops)
    if args.profile:
        profile(prefill_forward, device, steps=1)
    if args.host and device.type == "cuda":
        host_side(prefill_forward)
    if args.sources:
        sources(prefill_forward, steps=1)


if __name__ == "__main__":
    main()
