"""Load on vLLM's OpenAI server serving DeepSeek-V4.1: concurrent clients, mixed requests.

    python benchmarks/serve_load.py [--model DIR | --url URL] [--concurrency 1,8,32]
                                    [--requests 48] [--dtype bfloat16] [--seed 0]

Without ``--url``, the script starts ``vllm serve`` on ``--model`` (default: the
``tiny`` preset written into a temporary directory) and stops it at the end.

Every concurrency level sends the same ``--requests`` requests to
``/v1/completions`` (random token-id prompts, ``ignore_eos``, so each request
produces exactly its ``max_tokens``), from that many concurrent clients:

* prompt lengths drawn from 16..768 tokens, ``max_tokens`` from 8..96;
* one in three streams (time to first token is measured on these);
* one in eight streams and disconnects after its second chunk (counted apart:
  "disconnected" is the expected outcome, never "completed" or "failed");
* the rest wait for the whole answer.

Per level: completed / failed / disconnected, output tokens/s (completed
requests' tokens over the level's wall time), p50/p95 latency of completed
requests, p50/p95 time to first token of the streaming ones, and the tokens/s
ratio to concurrency 1 measured in the same run (the first level). After the
last level the server must still answer ``/health`` and a greedy request. Every
request's prompt differs per level (no prefix-cache hits across levels).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Outcome:
    kind: str  # completed | failed | disconnected
    tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None
    error: str = ""


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    mode: str  # plain | stream | disconnect


def workload(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        mode = "disconnect" if i % 8 == 7 else "stream" if i % 3 == 1 else "plain"
        length = rng.randint(16, 768)
        specs.append(Spec([rng.randint(3, 120000) for _ in range(length)], rng.randint(8, 96), mode))
    return specs


async def one_request(client: httpx.AsyncClient, url: str, model: str, spec: Spec) -> Outcome:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    try:
        if spec.mode == "plain":
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code != 200:
                return Outcome("failed", error=f"{r.status_code} {r.text[:200]}")
            tokens = r.json()["usage"]["completion_tokens"]
            return Outcome("completed", tokens, time.perf_counter() - start)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        chunks, ttft, tokens = 0, None, 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome("failed", error=f"{r.status_code} {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if spec.mode == "disconnect" and chunks >= 2:
                    return Outcome("disconnected", ttft=ttft)  # leaving the block closes the stream
        if tokens != spec.max_tokens:
            return Outcome("failed", error=f"{tokens} tokens of {spec.max_tokens}")
        return Outcome("completed", tokens, time.perf_counter() - start, ttft)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        return Outcome("failed", error=repr(e)[:200])


async def run_level(url: str, model: str, specs: list[Spec], concurrency: int) -> tuple[list[Outcome], float]:
    queue = list(enumerate(specs))
    results: list[Outcome | None] = [None] * len(specs)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def worker() -> None:
            while queue:
                index, spec = queue.pop(0)
                results[index] = await one_request(client, url, model, spec)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return [r for r in results if r is not None], wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: str, dtype: str, log_path: Path):
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        model_dir,
        "--served-model-name",
        "bench",
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--seed",
        "0",
        "--port",
        str(port),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise TimeoutError(log_path.read_text()[-3000:])
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: tiny preset in a temp dir)")
    parser.add_argument("--url", help="an already running server (its served model name via --served-name)")
    parser.add_argument("--served-name", default="bench")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            model = args.model
            if model is None:
                from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

                model = str(tmp / "tiny")
                make_checkpoint(model, preset="tiny", seed=0)
            log_path = tmp / "server.log"
            url = stack.enter_context(serve(model, args.dtype, log_path))
        started = "" if args.url else f" (started here: {args.model or 'tiny preset'}, {args.dtype})"
        print(f"server {url}{started}; {args.requests} requests per level")
        print(
            "| clients | completed | failed | disconnected | output tok/s | vs 1 client "
            "| latency p50 / p95 s | TTFT p50 / p95 s | wall s |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        baseline = None
        failures: list[str] = []
        for level_index, concurrency in enumerate(levels):
            specs = workload(args.requests, args.seed * 1000 + level_index)
            outcomes, wall = asyncio.run(run_level(url, args.served_name, specs, concurrency))
            done = [o for o in outcomes if o.kind == "completed"]
            failed = [o for o in outcomes if o.kind == "failed"]
            failures += [o.error for o in failed]
            rate = sum(o.tokens for o in done) / wall
            baseline = baseline or rate
            latencies = [o.latency for o in done]
            ttfts = [o.ttft for o in outcomes if o.ttft is not None]
            print(
                f"| {concurrency} | {len(done)} | {len(failed)} "
                f"| {len(outcomes) - len(done) - len(failed)} "
                f"| {rate:.1f} | {rate / baseline:.2f}x | {percentile(latencies, 0.5):.2f} / "
                f"{percentile(latencies, 0.95):.2f} | {percentile(ttfts, 0.5):.2f} / "
                f"{percentile(ttfts, 0.95):.2f} | {wall:.1f} |",
                flush=True,
            )
        health = httpx.get(f"{url}/health", timeout=30).status_code
        probe = httpx.post(
            f"{url}/v1/completions",
            timeout=300,
            json={"model": args.served_name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        ).status_code
        print(f"after the load: /health {health}, a new request {probe}")
        for error in failures[:10]:
            print(f"failure: {error}")
        if failures or health != 200 or probe != 200:
            sys.exit(1)


if __name__ == "__main__":
    main()
