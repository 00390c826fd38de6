"""The whole engine on the simulated NPU (``DEEPINFER_SIMULATED_NPU=1``) reproduces the reference.

vLLM resolves its platform once per process, so the engine runs in a fresh
process: ``vllm.LLM`` on DeepInfer's Ascend platform, worker and runner with
the device layer stubbed (vLLM's device runner, with separate host and
"device" buffers), chunked prefill (32-token chunks), a KV budget small
enough to preempt, and a prefix-cache hit on a repeated prompt. Its greedy
tokens must equal the reference's (as on the CPU platform, see
tests/e2e/test_llm_chunked_preemption.py), and its log must name the Ascend
platform as on a real 950.

Every process of every engine here runs as on an Ascend host without Triton
(``TRITON_GUARD``): ``triton`` cannot be imported, so vLLM's Triton kernels
are placeholders, and launching one records its name and raises. Each test
checks that nothing was recorded: the platform's PyTorch kernels
(``platforms/ascend/kernels.py``) ran instead.
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
from server_process import on_worker_core, openai_server  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform
        model, prompts, extra = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        mixed = extra.pop("mixed_sampling", False)
        batch_only = extra.pop("batch_only", False)  # the batch alone: no repeated prompt, no prefix hit
        settings = dict(max_num_batched_tokens=32, num_gpu_blocks_override=20)
        settings.update(extra)
        llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enable_chunked_prefill=True,
                  enable_prefix_caching=True, disable_log_stats=False, **settings)
        def metric(name):
            return sum(m.value for m in llm.get_metrics() if m.name == name)
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        preempt0 = metric("vllm:num_preemptions")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        batched = [list(o.outputs[0].token_ids) for o in outs]
        request_ids = [o.request_id for o in outs]
        preempted = metric("vllm:num_preemptions") - preempt0
        hits0 = metric("vllm:prefix_cache_hits")
        again = None
        if not batch_only:
            again_out = llm.generate([{"prompt_token_ids": prompts[2]}], greedy)[0]
            again = list(again_out.outputs[0].token_ids)
            request_ids.append(again_out.request_id)
        hits = metric("vllm:prefix_cache_hits") - hits0
        mixed_out, mixed_drafts = None, None
        if mixed:
            # One batch of a greedy, a seeded top-k/top-p and an unseeded top-p request.
            sampled = dict(max_tokens=16, ignore_eos=True)
            params = [greedy, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, **sampled),
                      SamplingParams(temperature=1.0, top_p=0.95, **sampled)]
            drafts0 = metric("vllm:spec_decode_num_drafts")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            mixed_out = [list(o.outputs[0].token_ids) for o in outs]
            mixed_drafts = metric("vllm:spec_decode_num_drafts") - drafts0
        cfg = llm.llm_engine.vllm_config
        runner = llm.collective_rpc("deepinfer_runner_info")[0]
        print("RESULT " + json.dumps({
            "mixed": mixed_out, "mixed_drafts": mixed_drafts,
            "platform": type(current_platform).__name__,
            "device": current_platform.get_device_name(),
            "worker_cls": cfg.parallel_config.worker_cls,
            "block_size": cfg.cache_config.block_size, "runner": runner,
            "batched": batched, "again": again, "preemptions": preempted, "prefix_hits": hits,
            "drafts": metric("vllm:spec_decode_num_drafts"),
            "request_ids": request_ids, "replays": llm.collective_rpc("deepinfer_replay_log")[0],
        }))
    """
)


# Loaded by every process of an engine (they are spawned), before anything imports vLLM: no
# Triton, as on an Ascend host (vLLM's HAS_TRITON is False and its kernels are placeholders),
# and a placeholder that is launched (``kernel[grid]``, ``.run``, ``.warmup``) appends its
# name to the file named by DEEPINFER_TEST_TRITON_LAUNCHES and raises.
TRITON_GUARD = textwrap.dedent(
    """
    import inspect, os, sys
    sys.modules["triton"] = None
    import vllm.triton_utils

    class _Unlaunchable:
        def __init__(self, fn):
            self.fn, self.arg_names = fn, tuple(inspect.signature(fn).parameters)
            self.__name__, self.__qualname__, self.__module__ = fn.__name__, fn.__qualname__, fn.__module__

        def __getitem__(self, grid):
            name = f"{self.__module__}.{self.__qualname__}"
            with open(os.environ["DEEPINFER_TEST_TRITON_LAUNCHES"], "a") as f:
                f.write(name + "\\n")
            raise RuntimeError(f"Triton kernel launched on the NPU path: {name}")

        def __getattr__(self, attr):  # Triton's other launch paths
            if attr in ("run", "warmup"):
                self[None]
            raise AttributeError(attr)

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    def _jit(*args, **kwargs):
        return _Unlaunchable(args[0]) if args and callable(args[0]) else _Unlaunchable

    assert not vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.triton.jit = _jit
    """
)


def _guarded(directory: Path, env: dict, extra_site: str = "") -> Path:
    """``env`` updated so that the processes it starts run under ``TRITON_GUARD`` (and
    ``extra_site``); returns the file that records launched Triton kernels."""
    site = directory / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TRITON_GUARD + extra_site)
    launches = directory / "triton_launches.txt"
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), inherited]))
    env["DEEPINFER_TEST_TRITON_LAUNCHES"] = str(launches)
    return launches


def _no_triton_launch(launches: Path) -> None:
    assert not launches.exists(), f"Triton kernels launched:\n{launches.read_text()}"


# Negative control: the runner's host staging buffers never reach their device twins.
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
    launches = _guarded(tmp_path, env, DROP_COPIES if drop_copies else "")
    for name in ("DEEPINFER_PLATFORM", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(script), checkpoint, json.dumps(prompts), json.dumps(extra)],
        check=False, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
        preexec_fn=on_worker_core(),
    )
    log = proc.stdout + proc.stderr
    _no_triton_launch(launches)
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


def _replayed_reference(result, prompts, tiny_greedy, replay_admissions):
    """The reference's tokens of the batch and the repeated prompt, with the prefix hits and
    preemptions the worker logged (SWA bounded replay)."""
    admissions = replay_admissions(result["replays"])
    want = [tiny_greedy(p, 16, admissions=admissions[r]) for p, r in zip(prompts, result["request_ids"])]
    if result["again"] is None:  # batch_only
        return want, None
    return want, tiny_greedy(prompts[2], 16, admissions=admissions[result["request_ids"][3]])


@pytest.mark.xdist_group("test_simulated_npu_engine_matches_reference")  # one engine each: side by side
def test_simulated_npu_engine_matches_reference(
    tiny_checkpoint, acceptance_prompts, tiny_greedy, replay_admissions, tmp_path
):
    result, log = _run(tiny_checkpoint, acceptance_prompts, tmp_path)
    batched, again = _replayed_reference(result, acceptance_prompts, tiny_greedy, replay_admissions)
    assert result["batched"] == batched
    assert result["again"] == again
    # The repeated prompt's hit was replayed (SWA bounded replay on the NPU runner too).
    assert any(start for _, start, _ in result["replays"]), result["replays"]
    assert result["preemptions"] > 0, "the KV budget did not force a preemption"
    assert result["prefix_hits"] > 0, "the repeated prompt did not hit the prefix cache"
    assert "DeepInfer V4.1 on Ascend (Ascend950PR (simulated), simulated on CPU tensors)" in log
    assert "dspark=off" in log
    # vLLM's default engram_config (cpu_offload): Engram rows in host memory, every step's rows
    # hashed on the host and copied into separate device buffers (model_executor.engram_host).
    engram = result["runner"]["engram"]
    assert engram["transfer"] == "copy" and engram["device_bytes"] == 0, engram
    assert engram["host_bytes"] == 290 * (32 + 1) and engram["rows_moved"] > 0, engram
    assert "DeepInfer V4.1 Engram: rows in host memory (cpu_offload=True), copy transfer" in log


@pytest.mark.xdist_group("test_simulated_npu_dspark_is_lossless")  # one engine each: side by side
def test_simulated_npu_dspark_is_lossless(
    tiny_dspark_checkpoint, acceptance_prompts, reference_greedy, tiny_greedy, replay_admissions, tmp_path
):
    """DSpark (k=3, adaptive verification) driven by the NPU runner as on CPU: the target's tokens."""
    result, log = _run(
        tiny_dspark_checkpoint, acceptance_prompts, tmp_path,
        max_num_batched_tokens=64, num_gpu_blocks_override=64,
        speculative_config={"method": "dspark", "num_speculative_tokens": 3, "enable_adaptive_verification": True},
        mixed_sampling=True,
    )
    batched, again = _replayed_reference(result, acceptance_prompts, tiny_greedy, replay_admissions)
    assert result["batched"] == batched
    assert result["again"] == again
    assert result["drafts"] > 0, "nothing was drafted"
    # Greedy and sampled requests verified in one batch (both rejection kernels, recovered
    # tokens, top-k/top-p, seeded and unseeded draws): the greedy one keeps its tokens.
    assert result["mixed_drafts"] > 0, "nothing was drafted in the mixed batch"
    assert result["mixed"][0] == reference_greedy[0]
    assert all(len(tokens) == 16 for tokens in result["mixed"])
    assert "dspark=k=3 adaptive=True" in log


@pytest.mark.xdist_group("test_simulated_npu_catches_a_missing_host_to_device_copy")  # one engine each: side by side
def test_simulated_npu_catches_a_missing_host_to_device_copy(
    tiny_checkpoint, acceptance_prompts, tiny_greedy, replay_admissions, tmp_path
):
    """The simulation can fail: with the runner's copies to the device dropped, the model reads
    stale device buffers and the tokens leave the reference the same engine meets with its copies
    (``test_simulated_npu_engine_matches_reference``: the reference with the replays the worker
    logged; on the CPU runner, whose device buffers are its host buffers, the same change would go
    unnoticed). The two shorter prompts in one batch are enough (the 200-token one and the repeated
    prompt took half the run)."""
    prompts = acceptance_prompts[:2]
    result, _ = _run(tiny_checkpoint, prompts, tmp_path, drop_copies=True, batch_only=True)
    batched, _ = _replayed_reference(result, prompts, tiny_greedy, replay_admissions)
    assert [len(tokens) for tokens in result["batched"]] == [16, 16]
    assert result["batched"] != batched


# ------------------------------------------------------------- the OpenAI server on it
@pytest.fixture(scope="module")
def npu_server(tiny_checkpoint, tmp_path_factory):
    """``vllm serve``'s server on the simulated NPU (fp32, chunked prefill in 32-token chunks)."""
    log_path = tmp_path_factory.mktemp("npu_server") / "server.log"
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
            "--max-num-batched-tokens", "32"]
    env = {"DEEPINFER_SIMULATED_NPU": "1", "DEEPINFER_PLATFORM": "auto"}
    launches = _guarded(log_path.parent, env)
    with openai_server(tiny_checkpoint, args, log_path, env=env, pin=True) as url:
        yield url, log_path, launches


@pytest.mark.xdist_group("npu_server")
def test_simulated_npu_server_prompt_logprobs_equal_the_reference(
    npu_server, tiny_reference, acceptance_prompts, reference_greedy_full_prefill
):
    """The request that once killed this engine (dynamo in vLLM's compiled sampler op met a
    ``torch.Event`` that was not a type): greedy tokens and prompt logprobs as the reference's."""
    import torch

    url, log_path, launches = npu_server
    # Requests asking prompt logprobs compute every prompt row (no truncation, no prefix hit).
    for prompt, want in zip(acceptance_prompts, reference_greedy_full_prefill):
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
    _no_triton_launch(launches)


@pytest.mark.xdist_group("npu_server")
def test_request_options_simulated_npu(npu_server):
    outcomes = run_matrix(Server(npu_server[0]))
    print(outcomes)
    assert all(v == "answered" for v in outcomes.values()), outcomes
    _no_triton_launch(npu_server[2])
