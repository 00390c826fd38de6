"""Prefill and decode tokens/s of DeepSeek-V4.1 (tiny preset) against vLLM's Llama, on CPU.

    python benchmarks/cpu_engine.py [--dtype bfloat16|float32] [--prefill-len 256]
                                    [--num-prompts 8] [--decode-tokens 64] [--model-dir DIR]
                                    [--repeats 3] [--batch-invariant]

Both models run through ``vllm.LLM`` on vLLM's CPU build with the same engine
settings, one after the other in the same invocation:

* V4.1: the plugin's ``tiny`` preset, written by ``make_checkpoint`` into a
  temporary directory (or into / from ``--model-dir``, reused when it already
  holds a checkpoint);
* Llama: vLLM's in-tree ``LlamaForCausalLM`` with random weights, built here
  with Transformers to V4.1 tiny's hidden size, layer count and vocabulary,
  an MLP as wide as V4.1's active experts (expert width x (top-k + shared)),
  4 heads, and V4.1's tokenizer files.

Prompts are random token ids (no tokenizer in the timed path), different in
every phase so that prefix caching never hits. Each engine is warmed up once
(one prefill and one decode call), then each phase runs ``--repeats`` times and
the table shows the median run (every run is listed below it).

* prefill: ``--num-prompts`` prompts of ``--prefill-len`` tokens, ``max_tokens=1``;
  tokens/s = prompt tokens / wall time of the ``generate`` call;
* decode: ``--num-prompts`` prompts of 16 tokens generating ``--decode-tokens``
  tokens each (``ignore_eos``); tokens/s = generated tokens / wall time of the
  call (its short prefill included).

With ``--batch-invariant``, V4.1 runs a second time with
``DEEPINFER_BATCH_INVARIANT=1`` (its first run has ``0``), and the table adds the
ratio of the two: the cost of batch invariance.

Each model runs in its own ``multiprocessing`` spawn child, so the first
engine (and its engine-core process) is gone before the second starts; the
child checks that its engine-core processes exited after ``del llm``. vLLM's
logs are relayed to stderr; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import random
import re
import shutil
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

DECODE_PROMPT_LEN = 16
MAX_MODEL_LEN = 1024
SEED = 0
# Token ids drawn for prompts: below V4.1's special / image tokens (>= 128000).
TOKEN_LOW, TOKEN_HIGH = 10, 100_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
KV_LOG = re.compile(r"DeepInfer V4\.1 caches: (\{.*?\}) bytes/token \(block (\d+), page (\d+) B\)")
KV_TOKENS_LOG = re.compile(r"CPU KV cache size: ([\d,]+) tokens")
CORES_LOG = re.compile(r"local_rank=0, core ids=(\[[^\]]*\])")


# ----------------------------------------------------------------- checkpoints
def build_v41(model_dir: Path) -> Path:
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(model_dir, preset="tiny", seed=SEED)


def llama_shape(v41_dir: Path) -> dict:
    """Llama dimensions matched to the V4.1 checkpoint's text config."""
    cfg = json.loads((v41_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    active_experts = text["num_experts_per_tok"] + text.get("n_shared_experts", 0)
    heads = 4
    return {
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": text["num_hidden_layers"],
        "vocab_size": text["vocab_size"],
        "intermediate_size": text["moe_intermediate_size"] * active_experts,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": text["hidden_size"] // heads,
        "bos_token_id": cfg.get("bos_token_id", 0),
        "eos_token_id": cfg.get("eos_token_id", 1),
        "pad_token_id": cfg.get("pad_token_id", 2),
    }


def build_llama(llama_dir: Path, v41_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = llama_shape(v41_dir)
    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    llama_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(llama_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (v41_dir / name).exists():
            shutil.copy2(v41_dir / name, llama_dir / name)
    return llama_dir


def safetensors_params(model_dir: Path) -> dict[str, int]:
    """Logical parameter counts from the safetensors headers (no data read).

    Scale tensors (UE8M0) are not parameters; packed FP4 (I8) holds two per byte.
    ``run`` excludes what the V4.1 engine loads but does not run (DSpark ``mtp.*``,
    the vision tower); ``embed`` counts embedding and LM head.
    """
    counts = {"total": 0, "run": 0, "embed": 0}
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__" or meta["dtype"] == "F8_E8M0":
                continue
            numel = math.prod(meta["shape"]) * (2 if meta["dtype"] == "I8" else 1)
            counts["total"] += numel
            top = name.removeprefix("model.").split(".")[0]
            if top in ("mtp", "vision", "aligner", "image_start", "image_end", "image_newline"):
                continue
            counts["run"] += numel
            if top in ("embed", "head", "embed_tokens", "lm_head"):
                counts["embed"] += numel
    return counts


# ----------------------------------------------------------------- the child
def _prompts(rng: random.Random, n: int, length: int) -> list:
    from vllm.inputs import TokensPrompt

    return [
        TokensPrompt(prompt_token_ids=[rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)])
        for _ in range(n)
    ]


def _timed_generate(llm, prompts, params) -> tuple[float, int, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return elapsed, prompt_tokens, generated


def _show_plugin_logs(work_dir: Path) -> None:
    """Let the engine processes print the plugin's INFO logs (e.g. its KV bytes/token).

    The plugin logs through stdlib ``logging`` under ``deepinfer_vllm``, which vLLM's
    default config leaves without a handler (INFO is dropped). vLLM's own default
    config plus that logger goes to ``VLLM_LOGGING_CONFIG_PATH``, which the
    engine-core and worker processes read at start; left alone if the user set it.
    """
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    try:
        import copy

        from vllm.logger import DEFAULT_LOGGING_CONFIG

        config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
        config["loggers"]["deepinfer_vllm"] = {"handlers": ["vllm"], "level": "INFO", "propagate": False}
        path = work_dir / "vllm_logging.json"
        path.write_text(json.dumps(config))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, OSError):
        traceback.print_exc()  # optional: the benchmark runs without the plugin's logs


def run_model(model_dir: str, args: dict, log_path: str, result_path: str) -> None:
    """Spawn-child entry point: one engine, warm-up, prefill and decode timings."""
    # Everything this process and its engine-core child print goes to the log file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    result: dict = {}
    try:
        import psutil
        from vllm import LLM, SamplingParams

        _show_plugin_logs(Path(log_path).parent)
        t0 = time.perf_counter()
        llm = LLM(
            model=model_dir,
            dtype=args["dtype"],
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            seed=SEED,
        )
        result["load_s"] = time.perf_counter() - t0
        # vLLM's engine-core and worker processes (not multiprocessing's resource tracker).
        engine_procs = [
            p
            for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())
        ]
        result["engine_pids"] = [p.pid for p in engine_procs]

        rng = random.Random(SEED)
        n, plen, dtok = args["num_prompts"], args["prefill_len"], args["decode_tokens"]
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        decode_params = SamplingParams(temperature=0.0, max_tokens=dtok, ignore_eos=True)

        # Warm-up: one pass of each shape, on prompts the timed runs never see.
        t0 = time.perf_counter()
        llm.generate(_prompts(rng, n, plen), prefill_params, use_tqdm=False)
        llm.generate(_prompts(rng, n, DECODE_PROMPT_LEN), decode_params, use_tqdm=False)
        result["warmup_s"] = time.perf_counter() - t0

        # Timed runs, each on fresh prompts; the table shows the median run.
        result["loadavg_before"] = os.getloadavg()[0]
        for phase, length, params in (
            ("prefill", plen, prefill_params),
            ("decode", DECODE_PROMPT_LEN, decode_params),
        ):
            runs = []
            for _ in range(args["repeats"]):
                elapsed, ptoks, gtoks = _timed_generate(llm, _prompts(rng, n, length), params)
                tokens = ptoks if phase == "prefill" else gtoks
                runs.append({"s": elapsed, "tokens": tokens, "tok_s": tokens / elapsed})
            runs.sort(key=lambda r: r["tok_s"])
            result[phase] = {**runs[len(runs) // 2], "all_tok_s": [r["tok_s"] for r in runs]}

        result["loadavg_after"] = os.getloadavg()[0]

        # Tear-down: the engine-core process must exit once the LLM is collected.
        del llm
        gc.collect()
        _, alive = psutil.wait_procs(engine_procs, timeout=30)
        result["teardown_leftover"] = [p.pid for p in alive]
    except BaseException:  # noqa: BLE001  (any failure goes back to the parent)
        result["error"] = traceback.format_exc()
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()


def _relay(log_path: Path, pos: int) -> int:
    """Copy what the child logged since ``pos`` to our stderr."""
    try:
        with open(log_path, "rb") as f:
            f.seek(pos)
            chunk = f.read()
    except FileNotFoundError:
        return pos
    if chunk:
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    return pos + len(chunk)


def measure(name: str, model_dir: Path, args: argparse.Namespace, work: Path, env: dict | None = None) -> dict:
    """One model in a spawn child; ``env`` is set for the child (and its engine processes)."""
    ctx = mp.get_context("spawn")
    log_path, result_path = work / f"{name}.log", work / f"{name}.result.json"
    log_path.write_bytes(b"")
    result_path.unlink(missing_ok=True)
    child_args = {
        k: getattr(args, k) for k in ("dtype", "num_prompts", "prefill_len", "decode_tokens", "repeats")
    }
    proc = ctx.Process(target=run_model, args=(str(model_dir), child_args, str(log_path), str(result_path)))
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pos = 0
    while proc.is_alive():
        proc.join(0.5)
        pos = _relay(log_path, pos)
    _relay(log_path, pos)
    if not result_path.exists():
        raise RuntimeError(f"{name}: benchmark child exited with code {proc.exitcode} and no result")
    result = json.loads(result_path.read_text())
    if "error" in result:
        raise RuntimeError(f"{name}: benchmark child failed:\n{result['error']}")

    import psutil

    result["leftover_after_exit"] = [pid for pid in result["engine_pids"] if psutil.pid_exists(pid)]
    log = log_path.read_text(errors="replace")
    match = KV_LOG.search(log)
    if match:
        result["kv_log"] = {
            "bytes_per_token": match.group(1),
            "block": match.group(2),
            "page": match.group(3),
        }
    match = KV_TOKENS_LOG.search(log)
    if match:
        result["kv_tokens"] = int(match.group(1).replace(",", ""))
    match = CORES_LOG.search(log)
    if match:
        result["worker_cores"] = match.group(1)
    return result


# ----------------------------------------------------------------- report
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _tree_state() -> str:
    """Commit of the checkout and the uncommitted changes under ``deepinfer_vllm/`` (read-only git)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), *argv],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "deepinfer_vllm")
        return commit + (
            f" + {len(dirty.splitlines())} uncommitted files in deepinfer_vllm/" if dirty else ""
        )
    except (OSError, subprocess.SubprocessError):
        return "(no git)"


def _m(n: int) -> str:
    return f"{n / 1e6:.1f} M"


def report(args: argparse.Namespace, rows: list[tuple[str, dict, dict]], llama: dict, tree: str) -> str:
    import torch
    import transformers
    import vllm

    v41, lm = rows[0][1], rows[1][1]
    out = []
    out.append(
        f"CPU engine benchmark, {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}: "
        f"{os.cpu_count()} cores ({_cpu_model()}), vLLM worker on cores {v41.get('worker_cores', '?')}, "
        f"torch {torch.__version__}, vLLM {vllm.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, deepinfer-vllm {tree}"
    )
    out.append(
        f"dtype {args.dtype}, max_model_len {MAX_MODEL_LEN}, enforce_eager, seed {SEED}, "
        f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}; "
        f"prefill {args.num_prompts} x {args.prefill_len} tokens (max_tokens=1); "
        f"decode {args.num_prompts} x {DECODE_PROMPT_LEN}-token prompts, {args.decode_tokens} tokens each; "
        f"median of {args.repeats} timed runs after one warm-up"
    )
    out.append("")
    out.append("| model | params (non-embedding) | prefill tok/s | decode tok/s |")
    out.append("| --- | --- | ---: | ---: |")
    for label, res, params in rows:
        out.append(
            f"| {label} | {_m(params['run'])} ({_m(params['run'] - params['embed'])}) "
            f"| {res['prefill']['tok_s']:.1f} | {res['decode']['tok_s']:.1f} |"
        )
    out.append(
        f"| ratio V4.1 / Llama | | {v41['prefill']['tok_s'] / lm['prefill']['tok_s']:.3f} "
        f"| {v41['decode']['tok_s'] / lm['decode']['tok_s']:.3f} |"
    )
    if len(rows) > 2:
        bi = rows[2][1]
        out.append(
            f"| ratio V4.1 batch-invariant / V4.1 | | {bi['prefill']['tok_s'] / v41['prefill']['tok_s']:.3f} "
            f"| {bi['decode']['tok_s'] / v41['decode']['tok_s']:.3f} |"
        )
    out.append("")
    for label, res, params in rows:
        extra = ""
        if params["total"] != params["run"]:
            extra = f"; checkpoint {_m(params['total'])} incl. DSpark/vision, loaded but not run"
        if res["teardown_leftover"]:
            teardown = f"engine processes still alive after del llm: {res['teardown_leftover']}"
        else:
            teardown = f"engine processes ({len(res['engine_pids'])}) gone after del llm"
        if res["leftover_after_exit"]:
            teardown += f", alive after the child exited: {res['leftover_after_exit']}"
        spread = {
            phase: "/".join(f"{v:.0f}" for v in res[phase]["all_tok_s"]) for phase in ("prefill", "decode")
        }
        out.append(
            f"- {label}: load {res['load_s']:.1f} s, warm-up {res['warmup_s']:.1f} s, "
            f"prefill {res['prefill']['tokens']} tok in {res['prefill']['s']:.3f} s "
            f"(runs {spread['prefill']} tok/s), "
            f"decode {res['decode']['tokens']} tok in {res['decode']['s']:.3f} s "
            f"(runs {spread['decode']} tok/s); 1-min load average {res['loadavg_before']:.1f} before, "
            f"{res['loadavg_after']:.1f} after the timed runs; {teardown}{extra}"
        )
    kv = v41.get("kv_log")
    if kv:
        out.append(
            f"- V4.1 KV cache (plugin log): {kv['bytes_per_token']} bytes/token, "
            f"block {kv['block']}, page {kv['page']} B"
        )
    kv_bytes = 2 if args.dtype == "bfloat16" else 4
    llama_kv = 2 * llama["num_hidden_layers"] * llama["num_key_value_heads"] * llama["head_dim"] * kv_bytes
    out.append(
        f"- Llama: hidden {llama['hidden_size']}, {llama['num_hidden_layers']} layers, "
        f"MLP {llama['intermediate_size']}, {llama['num_attention_heads']} heads x {llama['head_dim']}, "
        f"vocab {llama['vocab_size']}; KV cache {llama_kv} bytes/token"
    )
    space = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    sized = [
        f"{label.split(' (')[0]} {res['kv_tokens']:,} tokens ({space / res['kv_tokens']:.0f} B/token)"
        for label, res, _ in rows
        if res.get("kv_tokens")
    ]
    if sized:
        out.append(
            f"- KV cache as vLLM sized it ({os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB): " + ", ".join(sized)
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prefill-len", type=int, default=256, help="prompt tokens per prefill prompt")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per phase (batch)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode prompt")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="V4.1 tiny checkpoint dir: reused if present, else built there",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per phase; the median is reported")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run V4.1 with DEEPINFER_BATCH_INVARIANT=1 and report its ratio to the default",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.prefill_len + 1 > MAX_MODEL_LEN or DECODE_PROMPT_LEN + args.decode_tokens > MAX_MODEL_LEN:
        parser.error(f"prompts plus generated tokens must fit max_model_len={MAX_MODEL_LEN}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    tree = _tree_state()  # before the runs: the tree may change while they go
    with tempfile.TemporaryDirectory(prefix="cpu_engine_bench_") as tmp:
        work = Path(tmp)
        v41_dir = build_v41(args.model_dir or work / "v41-tiny")
        llama_dir = build_llama(work / "llama", v41_dir)
        rows = []
        runs = [
            ("DeepSeek-V4.1 tiny (plugin)", "v41", v41_dir, {"DEEPINFER_BATCH_INVARIANT": "0"}),
            ("Llama (vLLM in-tree)", "llama", llama_dir, None),
        ]
        if args.batch_invariant:
            runs.append(
                ("DeepSeek-V4.1 tiny, DEEPINFER_BATCH_INVARIANT=1", "v41_bi", v41_dir, {"DEEPINFER_BATCH_INVARIANT": "1"})
            )
        for label, name, model_dir, env in runs:
            print(f"[cpu_engine] running {label} from {model_dir}", file=sys.stderr, flush=True)
            rows.append((label, measure(name, model_dir, args, work, env), safetensors_params(model_dir)))
        print(report(args, rows, llama_shape(v41_dir), tree), flush=True)


if __name__ == "__main__":
    main()
