"""The whole engine on the simulated NPU (``DEEPINFER_SIMULATED_NPU=1``) reproduces the reference.

vLLM resolves its platform once per process, so the engine runs in a fresh
process: ``vllm.LLM`` on DeepInfer's Ascend platform, worker and runner with
the device layer stubbed (vLLM's device runner, with separate host and
"device" buffers), chunked prefill (32-token chunks), a KV budget small
enough to preempt, and a prefix-cache hit on a repeated prompt. Its greedy
tokens must equal the reference's (as on the CPU platform, see
tests/e2e/test_llm_chunked_preemption.py), and its log must name the Ascend
platform as on a real 950.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the shared server helpers
from request_options import Server, run_matrix  # noqa: E402
from server_process import openai_server  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform
        model, prompts, extra = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        settings = dict(max_num_batched_tokens=32, num_gpu_blocks_override=24)
        settings.update(extra)
        llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enable_chunked_prefill=True,
                  enable_prefix_caching=True, disable_log_stats=False, **settings)
        def metric(name):
            return sum(m.value for m in llm.get_metrics() if m.name == name)
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        preempt0 = metric("vllm:num_preemptions")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        batched = [list(o.outputs[0].token_ids) for o in outs]
        preempted = metric("vllm:num_preemptions") - preempt0
        hits0 = metric("vllm:prefix_cache_hits")
        again = list(llm.generate([{"prompt_token_ids": prompts[2]}], greedy)[0].outputs[0].token_ids)
        hits = metric("vllm:prefix_cache_hits") - hits0
        cfg = llm.llm_engine.vllm_config
        runner = llm.collective_rpc("deepinfer_runner_info")[0]
        print("RESULT " + json.dumps({
            "platform": type(current_platform).__name__,
            "device": current_platform.get_device_name(),
            "worker_cls": cfg.parallel_config.worker_cls,
            "block_size": cfg.cache_config.block_size, "runner": runner,
            "batched": batched, "again": again, "preemptions": preempted, "prefix_hits": hits,
            "drafts": metric("vllm:spec_decode_num_drafts"),
        }))
    """
)


# Negative control, loaded by every process of the engine (they are spawned): the runner's
# host staging buffers never reach their device twins.
DROP_COPIES = textwrap.dedent(
    """
    from vllm.v1.utils import CpuGpuBuffer
    CpuGpuBuffer.copy_to_gpu = lambda self, n=None: self.gpu if n is None else self.gpu[:n]
    """
)


def _run(checkpoint, prompts, tmp_path, drop_copies=False, **extra) -> tuple[dict, str]:
    script = tmp_path / "run_simulated_npu.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DEEPINFER_SIMULATED_NPU="1", VLLM_CPU_KVCACHE_SPACE="1")
    if drop_copies:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(DROP_COPIES)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    for name in ("DEEPINFER_PLATFORM", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script), checkpoint, json.dumps(prompts), json.dumps(extra)],
        env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["platform"] == "DeepInferAscendPlatform"
    assert result["device"] == "Ascend950PR (simulated)"
    assert result["worker_cls"] == "deepinfer_vllm.platforms.ascend.worker.DeepInferNPUWorker"
    assert result["block_size"] == 64
    assert "DeepInfer's Ascend platform runs on Ascend950PR (simulated)" in log
    # vLLM's device runner, not the CPU runner: every host staging buffer has its own
    # "device" twin, so inputs reach the model only through the runner's copies.
    runner = result["runner"]
    assert runner["runner"] == "DeepInferNPUModelRunner" and runner["device"] == "cpu"
    assert runner["buffers"] >= 5 and runner["separate"] == runner["buffers"], runner
    return result, log


@pytest.mark.xdist_group("test_simulated_npu_engine_matches_reference")  # one engine each: side by side
def test_simulated_npu_engine_matches_reference(tiny_checkpoint, acceptance_prompts, reference_greedy, tmp_path):
    result, log = _run(tiny_checkpoint, acceptance_prompts, tmp_path)
    assert result["batched"] == reference_greedy
    assert result["again"] == reference_greedy[2]
    assert result["preemptions"] > 0, "the KV budget did not force a preemption"
    assert result["prefix_hits"] > 0, "the repeated prompt did not hit the prefix cache"
    assert "DeepInfer V4.1 on Ascend (Ascend950PR (simulated), simulated on CPU tensors)" in log
    assert "dspark=off" in log


@pytest.mark.xdist_group("test_simulated_npu_dspark_is_lossless")  # one engine each: side by side
def test_simulated_npu_dspark_is_lossless(tiny_dspark_checkpoint, acceptance_prompts, reference_greedy, tmp_path):
    """DSpark (k=3, adaptive verification) driven by the NPU runner as on CPU: the target's tokens."""
    result, log = _run(
        tiny_dspark_checkpoint, acceptance_prompts, tmp_path,
        max_num_batched_tokens=64, num_gpu_blocks_override=64,
        speculative_config={"method": "dspark", "num_speculative_tokens": 3, "enable_adaptive_verification": True},
    )
    assert result["batched"] == reference_greedy
    assert result["again"] == reference_greedy[2]
    assert result["drafts"] > 0, "nothing was drafted"
    assert "dspark=k=3 adaptive=True" in log


@pytest.mark.xdist_group("test_simulated_npu_catches_a_missing_host_to_device_copy")  # one engine each: side by side
def test_simulated_npu_catches_a_missing_host_to_device_copy(
    tiny_checkpoint, acceptance_prompts, reference_greedy, tmp_path
):
    """The simulation can fail: with the runner's copies to the device dropped, the model reads
    stale device buffers and the tokens leave the reference (on the CPU runner, whose device
    buffers are its host buffers, the same change would go unnoticed)."""
    result, _ = _run(tiny_checkpoint, acceptance_prompts, tmp_path, drop_copies=True)
    assert result["batched"] != reference_greedy


# ------------------------------------------------------------- the OpenAI server on it
@pytest.fixture(scope="module")
def npu_server(tiny_checkpoint, tmp_path_factory):
    """``vllm serve``'s server on the simulated NPU (fp32, chunked prefill in 32-token chunks)."""
    log_path = tmp_path_factory.mktemp("npu_server") / "server.log"
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
            "--max-num-batched-tokens", "32"]
    env = {"DEEPINFER_SIMULATED_NPU": "1", "DEEPINFER_PLATFORM": "auto"}
    with openai_server(tiny_checkpoint, args, log_path, env=env) as url:
        yield url, log_path


@pytest.mark.xdist_group("npu_server")
def test_simulated_npu_server_prompt_logprobs_equal_the_reference(
    npu_server, tiny_reference, acceptance_prompts, reference_greedy
):
    """The request that once killed this engine (dynamo in vLLM's compiled sampler op met a
    ``torch.Event`` that was not a type): greedy tokens and prompt logprobs as the reference's."""
    import torch

    url, log_path = npu_server
    for prompt, want in zip(acceptance_prompts, reference_greedy):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "prompt_logprobs": 1, "return_token_ids": True}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text[:2000]
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want
        ref = torch.log_softmax(tiny_reference.forward(prompt).double(), dim=-1)
        worst = max(
            abs(choice["prompt_logprobs"][pos][str(prompt[pos])]["logprob"] - ref[pos - 1, prompt[pos]].item())
            for pos in range(1, len(prompt))
        )
        assert worst < 1e-4, worst
    assert "DeepInfer's Ascend platform runs on Ascend950PR (simulated)" in log_path.read_text()


@pytest.mark.xdist_group("npu_server")
def test_request_options_simulated_npu(npu_server):
    outcomes = run_matrix(Server(npu_server[0]))
    print(outcomes)
    assert all(v == "answered" for v in outcomes.values()), outcomes
