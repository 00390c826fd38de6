"""V4.1 split over vLLM's process groups on CPU, each through vLLM's OpenAI server: tensor
parallelism, and data + expert parallelism. Both give the one-rank greedy tokens, prompt
logprobs within 1e-3, and each rank holds its share of the weights, measured in the running
workers (their logged resident bytes). The TP=2 server also runs the request-options matrix;
the DP=2 server drafts with DSpark on both engines (``tiny-dspark``: tiny's target weights
with a trained draft) and must still give the target's greedy tokens; it also balances the
experts (EPLB, a rebalance every 5 steps), and gives the same tokens after rebalances that moved
experts between the two engines' workers.

Two CPU workers on a 2-core host need ``VLLM_CPU_OMP_THREADS_BIND="0|1"``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
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
    tp_server, acceptance_prompts, reference_greedy_full_prefill, tiny_reference
):
    url, _ = tp_server
    choices = [_complete(url, p) for p in acceptance_prompts]
    # One rank equals the reference token for token (test_llm_matches_reference); requests asking
    # prompt logprobs compute every prompt row (no prefill truncation, no prefix-cache hit).
    assert [c["token_ids"] for c in choices] == reference_greedy_full_prefill
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
DSPARK_K = 5
# Expert load balancing (the plugin's spelling of vLLM's fields) with a short period, so that the
# server's tests run through several rebalances: 8 experts + 2 redundant = 5 slots per rank.
EPLB = {
    "enable_eplb": True,
    "eplb_config": {"window_size": 4, "step_interval": 5, "num_redundant_experts": 2},
}
SLOTS_PER_RANK = 5


@pytest.fixture(scope="module")
def dp_server(tiny_dspark_checkpoint, tmp_path_factory):
    parallel = ["--data-parallel-size", "2", "--enable-expert-parallel"]
    parallel += ["--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": DSPARK_K})]
    parallel += ["--additional-config", json.dumps(EPLB)]
    yield from _two_worker_server(tiny_dspark_checkpoint, tmp_path_factory, "dp", parallel)


def _complete(url: str, prompt: list[int], max_tokens: int = 16, engine: int | None = None) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    # vLLM's header that sends a request to one data-parallel engine.
    headers = {} if engine is None else {"X-data-parallel-rank": str(engine)}
    r = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]


def _concurrent_greedy_and_logprob_error(url, prompts, reference_greedy, tiny_reference) -> float:
    """The prompts sent at once (vLLM's balancer spreads them over the data-parallel engines, the
    idle one running dummy batches through the same collectives): asserts the reference's greedy
    tokens (every prompt row computed: the requests ask prompt logprobs) and returns the largest
    prompt-logprob error."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        choices = list(pool.map(lambda p: _complete(url, p), prompts))
    assert [c["token_ids"] for c in choices] == reference_greedy
    return _logprob_error(
        tiny_reference,
        prompts,
        [lambda pos, tok, c=c: c["prompt_logprobs"][pos][str(tok)]["logprob"] for c in choices],
    )


@DP
def test_dp2_ep_server_greedy_and_logprobs_match_one_rank(
    dp_server, acceptance_prompts, reference_greedy_full_prefill, tiny_reference
):
    url, log_path = dp_server
    worst = _concurrent_greedy_and_logprob_error(
        url, acceptance_prompts, reference_greedy_full_prefill, tiny_reference
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


def _spec_counters(url: str) -> dict[tuple[str, str], float]:
    """vLLM's spec-decode counters on ``/metrics`` per engine: {(engine, name): value}."""
    out: dict[tuple[str, str], float] = {}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r'^vllm:(spec_decode_num_\w+_total)\{[^}]*engine="(\d+)"[^}]*\} ([0-9.e+-]+)$', line)
        if m and "position=" not in line:
            out[(m[2], m[1])] = out.get((m[2], m[1]), 0.0) + float(m[3])
    return out


@DP
def test_dp2_ep_server_dspark_drafts_and_accepts_on_both_engines(dp_server, tiny_greedy):
    from deepinfer_vllm.tools.train_dspark import Recipe, recipe_prompts

    url, _ = dp_server
    recipe = Recipe()
    prompts = recipe_prompts(recipe)[0][:4]  # the draft's fitted prompts: drafts get accepted
    before = _spec_counters(url)
    # One engine at a time (the other idles through dummy batches and dummy drafts), then
    # both drafting at once.
    jobs = [[(prompts[0], 0)], [(prompts[1], 1)], [(prompts[2], 0), (prompts[3], 1)]]
    for batch in jobs:
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            choices = list(pool.map(lambda job: _complete(url, job[0], recipe.continuation, job[1]), batch))
        for (prompt, _), choice in zip(batch, choices):
            assert choice["token_ids"] == tiny_greedy(prompt, recipe.continuation)
    after = _spec_counters(url)
    for engine in ("0", "1"):
        delta = {name: v - before.get((e, name), 0.0) for (e, name), v in after.items() if e == engine}
        print(f"DP=2 + EP, DSpark k={DSPARK_K}, engine {engine}: {delta}")
        drafts = delta["spec_decode_num_drafts_total"]
        accepted = delta["spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and delta["spec_decode_num_draft_tokens_total"] == DSPARK_K * drafts
        assert accepted > 0


@DP
def test_dp2_ep_each_rank_holds_half_the_experts_and_engram(dp_server, tiny_dspark_checkpoint):
    _, log_path = dp_server
    header = _header_bytes(tiny_dspark_checkpoint)
    # Each worker logs what it holds after loading, measured from its parameters.
    lines = re.findall(
        rf"weights resident on tp 0/1 dp (\d)/2 \(expert group rank \d/2, whole experts, "
        rf"{SLOTS_PER_RANK} of 10 slots\): (.*)",
        log_path.read_text(),
    )
    ranks = {
        dp: dict((c, int(b)) for c, b in re.findall(r"(\w+) (\d+) B \(checkpoint", rest))
        for dp, rest in lines
    }
    assert set(ranks) == {"0", "1"}, lines
    for rows in ranks.values():
        # Routed experts: 5 slots of the 8 experts' bytes (4 experts + 1 redundant, load balancing).
        assert rows["experts"] * 8 == header["experts"] * SLOTS_PER_RANK, (rows["experts"], header["experts"])
        assert rows["engram"] * 2 == header["engram"], (rows["engram"], header["engram"])
        # Attention is data-parallel: dense weights, embedding and head are whole on every rank.
        assert rows["dense"] == header["dense"]
        assert rows["embedding_head"] == header["embedding_head"]
        # DSpark is on: its stages are held, their routed experts split like the target's.
        assert 0 < rows["dspark"] < header["dspark"]


def _moving_rebalances(log_path) -> list[tuple[int, int]]:
    """(rebalance, slots moved) of every rebalance that changed the map (EP rank 0's log lines)."""
    return [
        (int(n), int(moved))
        for n, moved in re.findall(
            r"DeepInfer EPLB rebalance (\d+) at step \d+: map changed, (\d+) of \d+ slots moved",
            log_path.read_text(),
        )
    ]


@DP
def test_dp2_ep_server_tokens_unchanged_after_expert_rebalances(
    dp_server, acceptance_prompts, reference_greedy_full_prefill, tiny_reference
):
    """EPLB on: after at least two rebalances that moved experts between the workers (the maps
    changed), the acceptance prompts still give the reference's greedy tokens and prompt
    logprobs within 1e-3 (the same checks as before any rebalance, above)."""
    url, log_path = dp_server
    # Repeated text routes most tokens to a few experts; more requests if the tests above made
    # too few steps for two moving rebalances.
    filler = [7, 8, 9, 10] * 12
    for _ in range(6):
        if len(_moving_rebalances(log_path)) >= 2:
            break
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: _complete(url, filler, engine=e), (0, 1)))
    moved = _moving_rebalances(log_path)
    assert len(moved) >= 2 and all(n > 0 for _, n in moved), moved
    worst = _concurrent_greedy_and_logprob_error(
        url, acceptance_prompts, reference_greedy_full_prefill, tiny_reference
    )
    print(f"DP=2 + EP + EPLB after {len(moved)} moving rebalances: prompt logprobs max |d| = {worst:.2e}")
    assert worst < 1e-3
