"""DSpark through vLLM's OpenAI server with tensor parallelism: greedy tokens equal the
reference, and the spec-decode counters appear on ``/metrics`` as for vLLM's own methods.

The server runs ``tiny-dspark`` on two tensor-parallel CPU workers with
``--speculative-config '{"method": "dspark", "num_speculative_tokens": 5}'``.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from server_process import TWO_WORKERS, openai_server


@pytest.fixture(scope="module")
def dspark_server(tiny_dspark_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("dspark_server") / "server.log"
    args = [
        "--served-model-name", "tiny", "--tensor-parallel-size", "2", "--dtype", "float32",
        "--max-model-len", "256", "--seed", "0",
        "--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": 5}),
    ]
    with openai_server(tiny_dspark_checkpoint, args, log_path, env=TWO_WORKERS) as url:
        yield url


def _counters(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:spec_decode_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            labels = re.search(r'position="(\d+)"', m[2] or "")
            key = m[1] + (f"[{labels[1]}]" if labels else "")
            out[key] = out.get(key, 0.0) + float(m[3])
    return out


def test_tp2_server_drafts_accepts_and_reports_metrics(dspark_server, tiny_greedy):
    from deepinfer_vllm.tools.train_dspark import Recipe, recipe_prompts

    recipe = Recipe()
    prompts = recipe_prompts(recipe)[0][:2]
    before = _counters(dspark_server)
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": recipe.continuation, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = requests.post(f"{dspark_server}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        assert r.json()["choices"][0]["token_ids"] == tiny_greedy(prompt, recipe.continuation)
    after = _counters(dspark_server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts = delta["vllm:spec_decode_num_drafts_total"]
    drafted = delta["vllm:spec_decode_num_draft_tokens_total"]
    accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [delta.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0.0) for i in range(5)]
    assert drafts > 0 and drafted == 5 * drafts
    assert 0 < accepted <= drafted
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a later slot is accepted only after the earlier ones
