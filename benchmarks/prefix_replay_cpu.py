"""Window KV out of the prefix cache (vLLM's SWA bounded replay) against window KV cached with the
prefix, through ``vllm.LLM`` on the CPU: prefix-cache hit rate and time to first token.

Workloads: ``--prefixes`` distinct random prefixes of ``--prefix-len`` tokens, each followed by a
suffix of its own (``--suffix-len`` tokens) in round 1. In round 2, ``shared`` sends each prefix
again with a new suffix (a document shared by several questions: the hit ends where the first
request's prompt went on, mid-prompt), ``multiturn`` sends each round-1 prompt again with a new
turn (a conversation: the hit ends at the first prompt's end). One request at a time, one token
generated (a request's latency is its time to first token). The KV budget (``--blocks``) holds
every prefix's global records (compressed KV, index keys, Engram ids) but not their window KV.
vLLM 0.32 retains a sliding-window group's cached blocks only at semantic checkpoints (prompt
ends, detected shared prefixes; ``prefix_cache_retention_interval=0``), so with window KV in the
cache a hit must also end at one of those.

Two engines one after the other, the same workload and budget: ``--no-swa-bounded-replay`` (window
KV cached with the prefix, prefill truncation off: the behaviour before), then vLLM's default (window
KV out of the prefix cache, a hit replaying its last window; compact prefill truncation). Reported
per engine and round: the prefix-cache hit rate (vLLM's counters: hit tokens / queried tokens) and
the median time to first token; and the ratios default / before. Round 1 has nothing to hit, so its
ratio is the truncation's alone.

Run: ``.venv/bin/python benchmarks/prefix_replay_cpu.py`` (options: ``--help``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch

PREDICTION = """\
Prediction (written before the first run), tiny preset (W = 8, 6 window layers, 2 KV sources), 8
prefixes of 2048 tokens, 160-token suffixes, 800 blocks of 64 tokens: a cached 64-token block costs 2
blocks of the budget without window KV (global records, Engram ids) and 8 with it (6 window layers
besides). Before: every finished request leaves ~ 35 x 8 blocks in the LRU pool, the pool holds fewer
than three requests' worth, so a prefix comes back eight requests later to find its blocks evicted:
round-2 hit rate ~ 0 (at most a stray block). Default: the 8 prefixes' global records (~ 8 x 70
blocks) fit beside a running request: round-2 hit rate ~ 2048 / 2208 = 0.93 (hits are whole blocks;
vLLM counts the replayed 8 tokens as hit). Time to first token in round 2: before, a whole
2208-token prefill; default, 8 + 160 tokens, so ~ 0.1x (the head's and the step's fixed costs keep
it above 168 / 2208 = 0.08). Round 1 (no hits): compact truncation computes the decoder half (3 of
6 layers) on 20 rows instead of 2208, ~ 0.6x.
Multiturn (predicted after the shared run, before running it): the round-1 prompt end (2176 after
flooring to blocks) is a retained checkpoint, and with sparse retention the cache keeps one window's
blocks per checkpoint, so the budget holds every conversation in both engines: round-2 hit rate ~
2176 / 2368 = 0.92 in both; TTFT ~ 0.8x (the default replays 8 more tokens but truncates the decoder
half of 200 rows to 20)."""


WORKLOADS = {
    "shared": "round 2 sends each prefix again with a new suffix (a document shared by questions)",
    "multiturn": "round 2 sends each round-1 prompt again with a new turn (a conversation)",
}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120000, (length,), generator=g).tolist() for _ in range(n)]


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _run(checkpoint: str, args, replay: bool, workload: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=checkpoint,
        dtype=args.dtype,
        max_model_len=args.prefix_len + 2 * args.suffix_len + 64,
        seed=0,
        enable_prefix_caching=True,
        swa_bounded_replay=replay,
        # vLLM 0.32 keeps sliding-window blocks only at semantic checkpoints (0); None keeps every
        # one (hits at any block boundary, window KV for every cached block).
        prefix_cache_retention_interval=None if (args.dense_retention and not replay) else 0,
        num_gpu_blocks_override=args.blocks,
        max_num_batched_tokens=args.batched_tokens,
        disable_log_stats=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefixes = _prompts(args.prefixes, args.prefix_len, 1)
    out = {}
    for rnd in (1, 2):
        suffixes = _prompts(args.prefixes, args.suffix_len, 100 + rnd)
        q0, h0 = _counter(llm, "vllm:prefix_cache_queries"), _counter(llm, "vllm:prefix_cache_hits")
        ttft, cached = [], []
        for i, suffix in enumerate(suffixes):
            prompt = prefixes[i] + suffix
            if workload == "multiturn":
                prefixes[i] = prompt  # the next round continues this conversation
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - t0)
            cached.append(o.num_cached_tokens)
        queries = _counter(llm, "vllm:prefix_cache_queries") - q0
        hits = _counter(llm, "vllm:prefix_cache_hits") - h0
        out[rnd] = {
            "hit_rate": hits / queries if queries else 0.0,
            "ttft_median": statistics.median(ttft),
            "ttft": ttft,
            "cached": cached,
        }
    del llm
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", help="a tiny-preset checkpoint folder (default: made in a temporary folder)"
    )
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=160)
    parser.add_argument("--blocks", type=int, default=800, help="num_gpu_blocks_override (64-token blocks)")
    parser.add_argument(
        "--batched-tokens", type=int, default=256, help="max_num_batched_tokens (prefill chunk)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workload", choices=("shared", "multiturn", "both"), default="both")
    parser.add_argument(
        "--dense-retention",
        action="store_true",
        help="before: keep every sliding-window block cached (prefix_cache_retention_interval=None)",
    )
    args = parser.parse_args()
    print(PREDICTION)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

            checkpoint = str(make_checkpoint(os.path.join(scratch, "tiny"), preset="tiny", seed=0))
        workloads = ("shared", "multiturn") if args.workload == "both" else (args.workload,)
        results = {w: (_run(checkpoint, args, False, w), _run(checkpoint, args, True, w)) for w in workloads}
    print(
        f"\n{args.prefixes} prefixes x {args.prefix_len} tokens + {args.suffix_len}-token suffixes, "
        f"{args.blocks} blocks, {args.dtype}"
    )
    for workload, (before, after) in results.items():
        print(f"\nworkload {workload}: {WORKLOADS[workload]}")
        print(
            f"{'round':>5} {'engine':>26} {'hit rate':>9} {'TTFT median s':>14}   cached tokens per request"
        )
        for rnd in (1, 2):
            for name, res in (("window KV cached (before)", before), ("window KV out (default)", after)):
                r = res[rnd]
                print(f"{rnd:>5} {name:>26} {r['hit_rate']:>9.3f} {r['ttft_median']:>14.3f}   {r['cached']}")
            ratio = after[rnd]["ttft_median"] / before[rnd]["ttft_median"]
            print(f"{rnd:>5} {'default / before':>26} {'':>9} {ratio:>14.3f}x")


if __name__ == "__main__":
    main()
