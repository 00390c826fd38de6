"""V4.1 split over vLLM's process groups on CPU, each through vLLM's OpenAI server: tensor
parallelism, and data + expert parallelism. Both give the one-rank greedy tokens, prompt
logprobs within 1e-3, and each rank holds its share of the weights, measured in the running
workers (their logged resident bytes). The TP=2 server also runs the request-options matrix.

Two CPU workers on a 2-core host need ``VLLM_CPU_OMP_THREADS_BIND="0|1"``.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import re
import time

import pytest
import requests
import torch
from request_options import Server, run_matrix
from server_process import TWO_WORKERS, openai_server

from deepinfer_vllm.configs.checkpoint import read_safetensors_index
from deepinfer_vllm.model_executor.resident_bytes import component_of

BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


def _header_bytes(model_dir: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, (shape, dtype) in read_safetensors_index(model_dir).items():
        out[component_of(name)] = out.get(component_of(name), 0) + BYTES[dtype] * math.prod(shape)
    return out


def _logprob_error(reference, prompts, per_prompt_logprobs) -> float:
    """Largest |logprob - reference| over every prompt position after the first."""
    worst = 0.0
    for prompt, got in zip(prompts, per_prompt_logprobs):
        ref = torch.log_softmax(reference.forward(prompt).double(), dim=-1)
        for pos in range(1, len(prompt)):
            worst = max(worst, abs(got(pos, prompt[pos]) - ref[pos - 1, prompt[pos]].item()))
    return worst


# ------------------------------------------------------------------ tensor parallel
# One-rank settings of the reference runs (fp32, 512 tokens, seed 0) with two workers.
FP32_ARGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--seed", "0"]


def _two_worker_server(checkpoint, tmp_path_factory, name: str, parallel: list[str]):
    log_path = tmp_path_factory.mktemp(name) / "server.log"
    with openai_server(checkpoint, FP32_ARGS + parallel, log_path, env=TWO_WORKERS) as url:
        yield url, log_path


@pytest.fixture(scope="module")
def tp_server(tiny_checkpoint, tmp_path_factory):
    yield from _two_worker_server(tiny_checkpoint, tmp_path_factory, "tp", ["--tensor-parallel-size", "2"])


def _resident_report(log_path, parallel: str) -> dict[str, dict[str, dict[str, int]]]:
    """Each worker's logged resident bytes: {rank: {component: {"resident", "checkpoint"}}}."""
    lines = re.findall(
        rf"weights resident on {parallel} \(expert group rank (\d)/2, [a-z ]+\): (.*)", log_path.read_text()
    )
    return {
        rank: {
            c: {"resident": int(r), "checkpoint": int(k)}
            for c, r, k in re.findall(r"(\w+) (\d+) B \(checkpoint (\d+) B\)", rest)
        }
        for rank, rest in lines
    }


TP = pytest.mark.xdist_group("tp_server")
DP = pytest.mark.xdist_group("dp_server")


@TP
def test_tp2_greedy_and_logprobs_match_one_rank(
    tp_server, acceptance_prompts, reference_greedy, tiny_reference
):
    url, _ = tp_server
    choices = [_complete(url, p) for p in acceptance_prompts]
    # One rank equals the reference token for token (test_llm_matches_reference).
    assert [c["token_ids"] for c in choices] == reference_greedy
    worst = _logprob_error(
        tiny_reference,
        acceptance_prompts,
        [lambda pos, tok, c=c: c["prompt_logprobs"][pos][str(tok)]["logprob"] for c in choices],
    )
    print(f"TP=2 prompt logprobs: max |d| = {worst:.2e}")
    assert worst < 1e-3


@TP
def test_tp2_each_rank_holds_half_the_split_weights(tp_server, tiny_checkpoint):
    header = _header_bytes(tiny_checkpoint)
    reports = _resident_report(tp_server[1], r"tp \d/2 dp 0/1")
    assert set(reports) == {"0", "1"}, reports
    for rows in reports.values():
        # Experts (intermediate slices), Engram rows and the vocab shards: exactly half.
        for comp in ("experts", "engram", "embedding_head"):
            assert rows[comp]["resident"] * 2 == header[comp], (comp, rows[comp], header[comp])
        # Heads, output groups and the shared expert are split; the latent KV,
        # compressor, indexer, norms and mHC are replicated.
        assert rows["dense"]["resident"] < header["dense"]
        assert (
            "dspark" not in rows and "vision" not in rows
        )  # components with no resident bytes are not logged
        assert rows["total"]["resident"] / rows["total"]["checkpoint"] <= 1.05
    assert reports["0"]["dense"] == reports["1"]["dense"]


@TP
def test_request_options_tp2(tp_server):
    outcomes = run_matrix(Server(tp_server[0]))
    print(outcomes)
    assert all(v == "answered" for v in outcomes.values()), outcomes


# ------------------------------------------------------ data + expert parallel (server)
@pytest.fixture(scope="module")
def dp_server(tiny_checkpoint, tmp_path_factory):
    parallel = ["--data-parallel-size", "2", "--enable-expert-parallel"]
    yield from _two_worker_server(tiny_checkpoint, tmp_path_factory, "dp", parallel)


def _complete(url: str, prompt: list[int]) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]


@DP
def test_dp2_ep_server_greedy_and_logprobs_match_one_rank(
    dp_server, acceptance_prompts, reference_greedy, tiny_reference
):
    url, log_path = dp_server
    # Concurrent requests: vLLM's balancer spreads them over both data-parallel
    # engines, and the idle one runs dummy batches through the same collectives.
    with cf.ThreadPoolExecutor(len(acceptance_prompts)) as pool:
        choices = list(pool.map(lambda p: _complete(url, p), acceptance_prompts))
    assert [c["token_ids"] for c in choices] == reference_greedy
    worst = _logprob_error(
        tiny_reference,
        acceptance_prompts,
        [lambda pos, tok, c=c: c["prompt_logprobs"][pos][str(tok)]["logprob"] for c in choices],
    )
    print(f"DP=2 + EP prompt logprobs: max |d| = {worst:.2e}")
    assert worst < 1e-3
    # Both engines served prompts (vLLM's per-engine stats lines).
    served = set()
    deadline = time.time() + 30
    while len(served) < 2 and time.time() < deadline:
        for engine, rate in re.findall(
            r"Engine (\d+): Avg prompt throughput: ([\d.]+)", log_path.read_text()
        ):
            if float(rate) > 0:
                served.add(engine)
        time.sleep(1)
    assert served == {"000", "001"}, served


@DP
def test_dp2_ep_each_rank_holds_half_the_experts_and_engram(dp_server, tiny_checkpoint):
    _, log_path = dp_server
    header = _header_bytes(tiny_checkpoint)
    # Each worker logs what it holds after loading, measured from its parameters.
    lines = re.findall(
        r"weights resident on tp 0/1 dp (\d)/2 \(expert group rank \d/2, whole experts\): (.*)",
        log_path.read_text(),
    )
    ranks = {
        dp: dict((c, int(b)) for c, b in re.findall(r"(\w+) (\d+) B \(checkpoint", rest))
        for dp, rest in lines
    }
    assert set(ranks) == {"0", "1"}, lines
    for rows in ranks.values():
        for comp in ("experts", "engram"):
            assert rows[comp] * 2 == header[comp], (comp, rows[comp], header[comp])
        # Attention is data-parallel: dense weights, embedding and head are whole on every rank.
        assert rows["dense"] == header["dense"]
        assert rows["embedding_head"] == header["embedding_head"]
