"""DSpark on the trained ``tiny-dspark`` checkpoint: accepted length and decode speed, CPU.

    python benchmarks/dspark.py [--model-dir DIR] [--dtype float32|bfloat16] [--repeats 3]

One ``vllm.LLM`` per setting (DSpark off; k = 1, 3, 5; k = 5 with adaptive verification),
each in its own spawned process, run one after the other in this invocation. Every setting
decodes greedily from two prompt sets:

* ``trained``: the recipe's own training prompts (``tools.train_dspark.recipe_prompts``),
  whose continuations the draft was fitted to: it measures the machinery at the acceptance
  a fitted draft reaches, not generalisation;
* ``held-out``: prompts of the same family the draft never saw.

Per set and setting: the mean accepted length per verify step (vLLM's metrics:
``1 + accepted / drafts``), and decode tokens/s per request at batch 1 (prompts one at a
time) and at batch 8 (eight at once), each the median of ``--repeats`` runs, with the ratio
to DSpark off measured in the same invocation. ``--decode-tokens`` defaults to the recipe's
continuation length (what the draft was fitted on). Logs go to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "off": None,
    "k=1": {"num_speculative_tokens": 1},
    "k=3": {"num_speculative_tokens": 3},
    "k=5": {"num_speculative_tokens": 5},
    "k=5 adaptive": {"num_speculative_tokens": 5, "enable_adaptive_verification": True},
}


def _metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def _run_setting(model_dir: str, dtype: str, spec, prompt_sets: dict, decode_tokens: int, repeats: int, queue) -> None:
    os.dup2(2, 1)  # vLLM logs to stdout; the table owns the parent's stdout
    try:
        from vllm import LLM, SamplingParams

        kwargs = {} if spec is None else {"speculative_config": {"method": "dspark", **spec}}
        llm = LLM(
            model=model_dir, dtype=dtype, max_model_len=256, seed=0, disable_log_stats=False,
            enable_prefix_caching=False, **kwargs,
        )
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)

        llm.generate([{"prompt_token_ids": prompt_sets["trained"][0]}], params)  # warm-up
        result = {}
        for set_name, prompts in prompt_sets.items():
            drafts0, acc0 = _metric(llm, "vllm:spec_decode_num_drafts"), _metric(llm, "vllm:spec_decode_num_accepted_tokens")
            b1, b8, tokens = [], [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts[:8]]
                b1.append(len(outs) * decode_tokens / (time.perf_counter() - t0) / 1)  # per request, one at a time
                t0 = time.perf_counter()
                outs8 = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)
                b8.append(len(outs8) * decode_tokens / (time.perf_counter() - t0) / len(outs8))
                tokens = [list(o.outputs[0].token_ids) for o in outs8]
            drafts = _metric(llm, "vllm:spec_decode_num_drafts") - drafts0
            accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens") - acc0
            result[set_name] = {
                "accepted_length": (1 + accepted / drafts) if drafts else None,
                "tok_s_batch1": statistics.median(b1),
                "tok_s_batch8": statistics.median(b8),
                "runs_batch1": b1,
                "runs_batch8": b8,
                "tokens": tokens,
            }
        del llm
        gc.collect()
        queue.put(("ok", result))
    except Exception as exc:  # reported by the parent
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="tiny-dspark checkpoint (written here if absent)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint
    from deepinfer_vllm.tools.train_dspark import Recipe, recipe_prompts

    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="tiny_dspark_"))
    if not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        make_checkpoint(model_dir, preset="tiny-dspark", seed=0)
        print(f"wrote and trained tiny-dspark in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    recipe = Recipe()
    trained, held = recipe_prompts(recipe)
    prompt_sets = {"trained": trained[:8], "held-out": held[:8]}
    decode_tokens = args.decode_tokens or recipe.continuation

    ctx = mp.get_context("spawn")
    results = {}
    for name, spec in SETTINGS.items():
        queue = ctx.Queue()
        proc = ctx.Process(
            target=_run_setting,
            args=(str(model_dir), args.dtype, spec, prompt_sets, decode_tokens, args.repeats, queue),
        )
        proc.start()
        status, payload = queue.get()
        proc.join(120)
        if proc.is_alive():  # engine teardown hung after the result was sent
            proc.terminate()
            proc.join(10)
        if status != "ok":
            print(f"{name}: {payload}", file=sys.stderr)
            return 1
        results[name] = payload

    off = results["off"]
    print(f"DSpark on tiny-dspark, CPU ({os.cpu_count()} cores), {args.dtype}, greedy, {decode_tokens} tokens/request")
    print(f"{'prompts':9} {'setting':13} {'acc. length':>11} {'b1 tok/s':>9} {'ratio':>6} {'b8 tok/s':>9} {'ratio':>6} {'same tokens':>11}")
    for set_name in prompt_sets:
        for name, res in results.items():
            r, o = res[set_name], off[set_name]
            acc = "-" if r["accepted_length"] is None else f"{r['accepted_length']:.2f}"
            print(
                f"{set_name:9} {name:13} {acc:>11} {r['tok_s_batch1']:9.1f} {r['tok_s_batch1'] / o['tok_s_batch1']:6.2f} "
                f"{r['tok_s_batch8']:9.1f} {r['tok_s_batch8'] / o['tok_s_batch8']:6.2f} {r['tokens'] == o['tokens']!s:>11}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
