"""Config decisions of DeepInfer's Ascend platform, on real vLLM configs of the tiny V4.1 checkpoint.

The configs are built in this process (whose platform is DeepInfer's CPU one)
and then handed to ``DeepInferAscendPlatform.check_and_update_config`` with
the fields the CPU platform decided put back to what the user asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms.ascend.platform import V41_NPU_WORKER, DeepInferAscendPlatform
from deepinfer_vllm.platforms.v41_config import V41_BACKEND

PROCESS_ENV = (
    "PYTORCH_NPU_ALLOC_CONF",
    "HCCL_BUFFSIZE",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "NUMEXPR_MAX_THREADS",
    "TORCHINDUCTOR_COMPILE_THREADS",
)


@pytest.fixture
def npu_host(host, clean_env):
    host(soc="Ascend950PR")
    for name in PROCESS_ENV:
        clean_env.delenv(name, raising=False)
    return clean_env


def _config(tiny_checkpoint, dtype="bfloat16", **user):
    """A V4.1 engine config as the user asked it (``block_size`` as given, worker ``auto``)."""
    from vllm.engine.arg_utils import EngineArgs

    import deepinfer_vllm

    deepinfer_vllm.register()
    # Built without the stub: transformers probes for torch_npu while it loads.
    stub, sys.modules["torch_npu"] = sys.modules.get("torch_npu"), None
    try:
        cfg = EngineArgs(model=tiny_checkpoint, dtype=dtype, max_model_len=512, **user).create_engine_config()
    finally:
        sys.modules["torch_npu"] = stub
    cfg.parallel_config.worker_cls = "auto"
    if "block_size" in user:
        cfg.cache_config.block_size = user["block_size"]
        cfg.cache_config.user_specified_block_size = True
    else:
        cfg.cache_config.user_specified_block_size = False
    return cfg


def test_device_attributes():
    p = DeepInferAscendPlatform
    assert (p.device_name, p.device_type, p.dispatch_key, p.dist_backend) == ("npu", "npu", "PrivateUse1", "hccl")
    assert p.device_control_env_var == "ASCEND_RT_VISIBLE_DEVICES" and p.ray_device_key == "NPU"
    assert p().is_out_of_tree() and not p().is_cpu()
    assert p.support_hybrid_kv_cache() and not p.support_static_graph_mode()


def _simulated_stdout(code: str) -> list[str]:
    """The words ``code`` prints in a fresh process on the simulated NPU (vLLM resolves its
    platform once per process)."""
    env = dict(os.environ, DEEPINFER_SIMULATED_NPU="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_simulated_attributes_in_a_fresh_process():
    code = (
        "from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform as P\n"
        "p = P()\n"
        "print(P.device_name, P.device_type, P.dispatch_key, P.dist_backend, p.is_cpu(), P.get_device_name(),\n"
        "      P.get_device_communicator_cls().rsplit('.', 1)[1], P.is_pin_memory_available())\n"
    )
    assert _simulated_stdout(code) == [
        "cpu", "cpu", "CPU", "gloo", "True", "Ascend950PR", "(simulated)", "DeviceCommunicatorBase", "False"
    ]


def test_memory_and_name_come_from_the_device_layer(npu_host):
    stub = sys.modules["torch_npu"]
    assert DeepInferAscendPlatform.get_device_name() == "Ascend950PR"
    with pytest.raises(NotImplementedError):  # before this process selected its NPU
        DeepInferAscendPlatform.get_device_total_memory(0)
    assert stub.context_calls == []
    DeepInferAscendPlatform.set_device(2)
    assert DeepInferAscendPlatform.get_device_total_memory(2) == 128 << 30
    assert DeepInferAscendPlatform.get_current_memory_usage() == 2 << 20


def test_attention_route():
    sparse = SimpleNamespace(use_sparse=True, use_mla=True)
    assert DeepInferAscendPlatform.get_attn_backend_cls(None, sparse) == V41_BACKEND
    with pytest.raises(NotImplementedError, match="vllm-ascend"):
        DeepInferAscendPlatform.get_attn_backend_cls(None, SimpleNamespace(use_sparse=False, use_mla=False))


def test_other_models_are_refused_by_name():
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(
            model="m", hf_config=SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
        )
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM.*vllm-ascend"):
        DeepInferAscendPlatform.check_and_update_config(cfg)


def test_v41_defaults_on_an_npu(npu_host, tiny_checkpoint):
    from vllm.config import CompilationMode, CUDAGraphMode

    npu_host.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:False")  # the user's own value stays
    cfg = _config(tiny_checkpoint)
    DeepInferAscendPlatform.check_and_update_config(cfg)
    assert cfg.cache_config.block_size == 64
    assert cfg.scheduler_config.enable_chunked_prefill is True
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.parallel_config.worker_cls == V41_NPU_WORKER
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.compilation_config.cudagraph_capture_sizes == []
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.parallel_config.disable_custom_all_reduce is True
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # HCCL's own defaults stand (200 MB buffers, 1836 s execution timeout): not set here.
    assert "HCCL_BUFFSIZE" not in os.environ and "HCCL_EXEC_TIMEOUT" not in os.environ
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "240"
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:False"
    assert sys.modules["torch_npu"].context_calls == []  # the config decisions open no device


def test_users_hccl_settings_are_kept(npu_host, tiny_checkpoint):
    npu_host.setenv("HCCL_BUFFSIZE", "512")
    npu_host.setenv("HCCL_EXEC_TIMEOUT", "600")
    DeepInferAscendPlatform.check_and_update_config(_config(tiny_checkpoint))
    assert (os.environ["HCCL_BUFFSIZE"], os.environ["HCCL_EXEC_TIMEOUT"]) == ("512", "600")


def test_user_settings_are_kept(npu_host, tiny_checkpoint):
    cfg = _config(tiny_checkpoint, block_size=128, enable_chunked_prefill=False, enable_prefix_caching=False,
                  max_num_batched_tokens=512)
    DeepInferAscendPlatform.check_and_update_config(cfg)
    assert cfg.cache_config.block_size == 128
    assert cfg.scheduler_config.enable_chunked_prefill is False
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.scheduler_config.max_num_batched_tokens == 512


def test_custom_worker_is_kept(npu_host, tiny_checkpoint):
    cfg = _config(tiny_checkpoint)
    cfg.parallel_config.worker_cls = "my.pkg.Worker"
    DeepInferAscendPlatform.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == "my.pkg.Worker"


def test_odd_block_size_is_refused(npu_host, tiny_checkpoint):
    cfg = _config(tiny_checkpoint)
    cfg.cache_config.block_size = 33
    cfg.cache_config.user_specified_block_size = True
    with pytest.raises(ValueError, match="even --block-size"):
        DeepInferAscendPlatform.check_and_update_config(cfg)


def test_simulated_npu_uses_the_host_profile(npu_host, tiny_checkpoint):
    npu_host.setenv("DEEPINFER_SIMULATED_NPU", "1")
    npu_host.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = _config(tiny_checkpoint)
    DeepInferAscendPlatform.check_and_update_config(cfg)
    assert cfg.cache_config.kv_cache_memory_bytes == 1 << 30  # the CPU platform's KV-space rule
    assert cfg.cache_config.block_size == 64  # not the CPU platform's 256 for DeepSeek-V4
    assert cfg.scheduler_config.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
    assert cfg.parallel_config.worker_cls == V41_NPU_WORKER
    assert "HCCL_BUFFSIZE" not in os.environ  # no device process variables on the host


def test_runner_is_vllms_device_runner_with_the_v41_additions(npu_host):
    """Not the CPU runner (which aliases every device buffer to its host buffer): vLLM's
    device runner, V4.1's shared additions first in the bases, syncing through the layer."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from deepinfer_vllm.platforms.ascend.worker import DeepInferNPUModelRunner
    from deepinfer_vllm.platforms.cpu_worker import DeepInferCPUModelRunner
    from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin

    assert DeepInferNPUModelRunner.__mro__[1:3] == (V41RunnerMixin, GPUModelRunner)
    assert not issubclass(DeepInferNPUModelRunner, CPUModelRunner)
    assert DeepInferCPUModelRunner.__mro__[1:3] == (V41RunnerMixin, CPUModelRunner)
    runner = object.__new__(DeepInferNPUModelRunner)
    runner.device = "npu:3"  # torch.device("npu:3") needs the real torch_npu
    runner._sync_device()
    stub = sys.modules["torch_npu"]
    assert [(name, str(args[0])) for name, args in stub.calls] == [("synchronize", "npu:3")]


def test_torch_api_points_vllms_device_calls_at_the_npu(npu_host):
    import torch

    stub = sys.modules["torch_npu"]
    before = (torch.cuda.Stream, torch.cuda.Event, torch.Event, torch.accelerator.synchronize)
    with npu.get().torch_api():
        assert torch.cuda.Stream is stub.npu.Stream and torch.cuda.Event is stub.npu.Event
        assert torch.cuda.Event(blocking=True).args == () and torch.cuda.Stream(3).args == (3,)
        assert torch.Event is before[2]  # device-generic: records on the NPU once torch_npu is loaded
        assert torch.cuda.current_stream() == "current"
        assert torch.cuda.stream("s") == "s"
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
    assert [name for name, _ in stub.calls] == ["synchronize", "empty_cache"]
    assert (torch.cuda.Stream, torch.cuda.Event, torch.Event, torch.accelerator.synchronize) == before


@pytest.mark.parametrize("simulated", [False, True])
def test_torch_api_replaces_classes_with_classes(npu_host, monkeypatch, simulated):
    """dynamo tests values with ``isinstance(value, torch.Event)`` (and the ``torch.cuda``
    classes): a replacement that is not a type killed the simulated NPU's engine on its
    first ``prompt_logprobs`` request, in vLLM's compiled ``batched_count_greater_than``."""
    import torch

    if simulated:
        monkeypatch.setenv("DEEPINFER_SIMULATED_NPU", "1")
    layer = npu.get()
    assert layer.simulated is simulated
    with layer.torch_api():
        for owner, name in ((torch.cuda, "Stream"), (torch.cuda, "Event"), (torch, "Event")):
            assert isinstance(getattr(owner, name), type), f"{owner.__name__}.{name}"
        if simulated:  # host tensors: the null event stands in for torch's CPU-less events
            event = torch.Event()
            event.record()
            assert event.query()


def test_vllms_compiled_sampler_op_runs_inside_the_simulated_torch_api(npu_host, monkeypatch):
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    monkeypatch.setenv("DEEPINFER_SIMULATED_NPU", "1")
    x = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.2, 0.4]])
    values = torch.tensor([[0.3], [0.4]])
    with npu.get().torch_api():
        torch._dynamo.reset()
        got = batched_count_greater_than(x, values)
    assert got.tolist() == [2, 2]  # ranks: elements >= the value, the value included


def test_worker_refuses_sleep(npu_host):
    from deepinfer_vllm.platforms.ascend.worker import DeepInferNPUWorker

    with pytest.raises(ValueError, match="sleep mode"):
        object.__new__(DeepInferNPUWorker).sleep()


def test_dtypes_on_an_npu(npu_host):
    """float32 routes to references that accumulate in float64, which the NPU's cube units
    lack: refused by name, in the user's process already (config) and in the worker."""
    import torch

    p = DeepInferAscendPlatform
    for dtype in (torch.bfloat16, torch.float16):
        p.check_if_supports_dtype(dtype)
    with pytest.raises(ValueError, match="does not run float32 models on an NPU.*--dtype bfloat16"):
        p.check_if_supports_dtype(torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16 models, not torch.float64"):
        p.check_if_supports_dtype(torch.float64)
    assert p().supported_dtypes == [torch.bfloat16, torch.float16]  # "auto" of a float32 checkpoint: bf16


def test_float32_config_is_refused_before_any_worker(npu_host, tiny_checkpoint):
    cfg = _config(tiny_checkpoint, dtype="float32")
    with pytest.raises(ValueError, match="does not run float32 models on an NPU"):
        DeepInferAscendPlatform.check_and_update_config(cfg)


def test_float32_runs_on_the_simulated_npu_in_a_fresh_process():
    """The simulated NPU keeps float32 (host arithmetic; its engine tests compare float32
    tokens with the CPU reference bit for bit); the same class refuses it on an NPU."""
    code = (
        "import torch\n"
        "from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform as P\n"
        "P.check_if_supports_dtype(torch.float32)\n"
        "print(P.simulated, torch.float32 in P().supported_dtypes, P.ue8m0_storage_dtype)\n"
    )
    assert _simulated_stdout(code) == ["True", "True", "torch.uint8"]


def test_inference_mode_is_torchs(npu_host):
    import torch

    with DeepInferAscendPlatform.inference_mode():
        assert torch.is_inference_mode_enabled()
        assert torch.ones(2).is_inference()


def test_ue8m0_scales_are_bytes_on_the_npu(npu_host):
    import torch

    assert DeepInferAscendPlatform.ue8m0_storage_dtype == npu.get().ue8m0_dtype == torch.uint8


def test_vllm_class_choice_is_refused_by_name(npu_host, tiny_checkpoint):
    cfg = _config(tiny_checkpoint)
    npu_host.setenv("DEEPINFER_MODEL", "vllm")
    with pytest.raises(ValueError, match="DEEPINFER_MODEL=vllm"):
        DeepInferAscendPlatform.check_and_update_config(cfg)
