"""The NPU worker's and runner's own logic, on stubs (no engine): which device each DP/TP
rank opens, that nothing opens one before ``set_device``, the KV budget on recorded memory
figures, the warm-up, the load-time OOM error, the generator rewind, and device-synchronised
timing of adaptive verification."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms.ascend import worker as npu_worker
from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform
from deepinfer_vllm.platforms.ascend.worker import (
    DeepInferNPUModelRunner,
    DeepInferNPUWorker,
    MemoryFigures,
    device_index,
    kv_cache_bytes,
    warm_up_sizes,
)

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def no_assigned_ids(monkeypatch):
    from vllm.platforms import interface

    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", None)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def _parallel(tp=1, pp=1, pcp=1, dp_local=0, backend="mp", dp_backend="mp", nnodes_within_dp=1,
              assigned=None, local_world_size=None):
    return SimpleNamespace(
        distributed_executor_backend=backend, data_parallel_backend=dp_backend,
        nnodes_within_dp=nnodes_within_dp, data_parallel_rank_local=dp_local, data_parallel_index=dp_local,
        pipeline_parallel_size=pp, prefill_context_parallel_size=pcp, tensor_parallel_size=tp,
        assigned_physical_gpu_ids=assigned, local_world_size=local_world_size or tp * pp * pcp,
    )


# ------------------------------------------------------------------ device mapping
@pytest.mark.parametrize("dp_local", [0, 1])
@pytest.mark.parametrize("tp_rank", [0, 1, 2, 3])
def test_each_dp_tp_rank_gets_its_own_npu(no_assigned_ids, dp_local, tp_rank):
    """Two data-parallel engines of TP=4 on one 8-NPU host: engine 1 starts at NPU 4."""
    rank, index = device_index(_parallel(tp=4, dp_local=dp_local), tp_rank, 8, DeepInferAscendPlatform)
    assert (rank, index) == (4 * dp_local + tp_rank, 4 * dp_local + tp_rank)


@pytest.mark.parametrize("tp_rank, want", [(0, 8), (1, 9), (3, 11)])
def test_prefill_context_parallel_and_pipeline_widen_each_engine(no_assigned_ids, tp_rank, want):
    """DP engine 1 of TP=2 x PCP=2 x PP=2 (8 ranks an engine) on a 16-NPU host."""
    parallel = _parallel(tp=2, pp=2, pcp=2, dp_local=1)
    assert device_index(parallel, tp_rank, 16, DeepInferAscendPlatform) == (want, want)


def test_vllms_parallel_config_drives_the_mapping(no_assigned_ids):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(tensor_parallel_size=4, data_parallel_size=2, data_parallel_rank_local=1,
                              data_parallel_size_local=2)
    assert device_index(parallel, 2, 8, DeepInferAscendPlatform) == (6, 6)


@pytest.mark.parametrize(
    "changes",
    [{"backend": "ray"}, {"backend": "external_launcher"}, {"dp_backend": "ray"}, {"nnodes_within_dp": 2}],
    ids=["ray", "external-launcher", "ray-dp", "dp-rank-over-nodes"],
)
def test_no_data_parallel_shift_where_vllm_places_no_engine(no_assigned_ids, changes):
    assert device_index(_parallel(tp=4, dp_local=1, **changes), 3, 8, DeepInferAscendPlatform) == (3, 3)


def test_a_rank_past_the_visible_npus_is_refused(no_assigned_ids):
    with pytest.raises(ValueError, match=r"local rank 9 \(after the data-parallel offset\).*8 NPU\(s\) visible"):
        device_index(_parallel(tp=8, dp_local=1), 1, 8, DeepInferAscendPlatform)


def test_visible_devices_map_logical_to_torch_index(no_assigned_ids):
    no_assigned_ids.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    assert device_index(_parallel(tp=4), 2, 4, DeepInferAscendPlatform) == (2, 2)


@pytest.mark.parametrize("tp_rank", [0, 3])
def test_data_parallel_engines_on_vllms_device_shards(no_assigned_ids, tp_rank):
    """vLLM's engine launcher gives each data-parallel engine of a non-CUDA platform its shard
    of the devices (here from vLLM's own function): engine 1 of TP=4 on 8 NPUs holds 4-7,
    and its rank ``tp_rank`` opens NPU ``4 + tp_rank``, not one past the shard."""
    from vllm.v1.engine.utils import get_physical_gpu_ids_for_local_dp_rank

    shard = get_physical_gpu_ids_for_local_dp_rank("ASCEND_RT_VISIBLE_DEVICES", 1, 4, 4)
    assert shard == [4, 5, 6, 7]
    parallel = _parallel(tp=4, dp_local=1, assigned=shard)
    assert device_index(parallel, tp_rank, 8, DeepInferAscendPlatform) == (tp_rank, 4 + tp_rank)


def test_assigned_device_ids_are_published_and_bounded(no_assigned_ids):
    from vllm.platforms import interface

    parallel = _parallel(tp=2, assigned=[6, 7])
    # No visible-devices list: the torch index is the physical id.
    assert device_index(parallel, 1, 8, DeepInferAscendPlatform) == (1, 7)
    assert interface.get_assigned_physical_gpu_ids() == [6, 7]
    no_assigned_ids.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,7")
    assert device_index(parallel, 1, 2, DeepInferAscendPlatform) == (1, 1)
    with pytest.raises(ValueError, match=r"local rank 2 has no device: assigned device ids \[6, 7\]"):
        device_index(parallel, 2, 8, DeepInferAscendPlatform)
    with pytest.raises(ValueError, match=r"4 ranks on this node but 2 assigned device ids"):
        device_index(_parallel(tp=2, assigned=[6, 7], local_world_size=4), 0, 8, DeepInferAscendPlatform)


# ------------------------------------------------------------------ init_device
def _worker(monkeypatch, *, local_rank=0, dp_local=0, tp=4, utilization=0.4):
    """A worker whose distributed set-up and runner are stubbed; the device is the stub's."""
    calls = []
    monkeypatch.setattr(npu_worker, "init_worker_distributed_environment", lambda *a: calls.append(("dist", a[3])))
    monkeypatch.setattr(npu_worker, "current_platform", DeepInferAscendPlatform())
    monkeypatch.setattr(DeepInferNPUWorker, "_init_workspace_and_model_runner", lambda self: calls.append("runner"))
    layer = npu.get()
    monkeypatch.setattr(layer, "torch_device", lambda i: SimpleNamespace(type="npu", index=i))
    w = object.__new__(DeepInferNPUWorker)
    w.local_rank, w.rank = local_rank, dp_local * tp + local_rank
    w.distributed_init_method = "tcp://x"
    w.parallel_config = _parallel(tp=tp, dp_local=dp_local)
    w.model_config = SimpleNamespace(dtype=torch.bfloat16, seed=0)
    w.cache_config = SimpleNamespace(gpu_memory_utilization=utilization, kv_cache_memory_bytes=None)
    w.vllm_config = SimpleNamespace()
    return w, calls


def test_init_device_opens_the_ranks_npu_first(host, no_assigned_ids, monkeypatch):
    """The first call of the process that needs a device context is ``set_device`` of this
    rank's NPU; the start-up snapshot comes after the communicators."""
    stub = host(soc="Ascend950PR", count=8)
    w, calls = _worker(monkeypatch, local_rank=2, dp_local=1)
    w.init_device()
    try:
        assert stub.context_calls[0] == "set_device"
        assert next(args for name, args in stub.calls if name == "set_device")[0].index == 6
        assert (w.local_rank, w.device.index) == (6, 6)
        assert calls == [("dist", 6), "runner"]
        assert (w.init_free, w.total_memory) == (64 * GIB, 128 * GIB)  # the stub's mem_get_info
        assert w.requested_memory == -(-128 * GIB * 4 // 10)  # ceil(0.4 x total)
    finally:
        w._torch_api.close()


def test_init_device_refuses_a_budget_larger_than_free_memory(host, no_assigned_ids, monkeypatch):
    """vLLM's start-up rule: utilization x total must be free when the worker starts."""
    host(soc="Ascend950PR", count=8)
    w, _ = _worker(monkeypatch, utilization=0.9)
    try:
        with pytest.raises(ValueError, match=r"Free NPU memory at start-up \(64.00/128.00 GiB\).*=0.9 asks \(115.20"):
            w.init_device()
    finally:
        w._torch_api.close()


# ------------------------------------------------------------------ KV budget
# Recorded on a 64 GiB device: 1.5 GiB held by others at start-up, 23.5 GiB held after the
# profiling step (weights, communicators, workspaces), a 3 GiB activation peak above that.
RECORDED = MemoryFigures(total=65536 * MIB, init_free=64000 * MIB, free_after=40960 * MIB,
                         peak=21504 * MIB, allocated_after=18432 * MIB)


def test_kv_budget_on_recorded_figures():
    kv, terms = kv_cache_bytes(RECORDED, 0.9)
    # ceil(0.9 x 64 GiB) = 61847529063; held 22.5 GiB; transient 3 GiB.
    assert terms == {"requested": 61847529063, "consumed": 24159191040, "transient": 3221225472}
    assert kv == 34467112551  # 61847529063 - 24159191040 - 3221225472


def test_kv_budget_ignores_memory_other_processes_held_before_start():
    """A context another process opened on this NPU before the worker started (2 GiB) is
    neither this instance's consumption nor its budget's: the same KV bytes. (The former
    ``budget - (total - free) - transient`` lost those 2 GiB on rank 0.)"""
    shifted = MemoryFigures(total=RECORDED.total, init_free=RECORDED.init_free - 2 * GIB,
                            free_after=RECORDED.free_after - 2 * GIB, peak=RECORDED.peak,
                            allocated_after=RECORDED.allocated_after)
    assert kv_cache_bytes(shifted, 0.9)[0] == kv_cache_bytes(RECORDED, 0.9)[0]


def test_kv_budget_refusals():
    with pytest.raises(ValueError, match="No NPU memory left for the KV caches"):
        kv_cache_bytes(RECORDED, 0.39)  # a 24.96 GiB budget: 22.5 GiB held + 3 GiB transient exceed it
    with pytest.raises(ValueError, match="Free NPU memory at start-up"):
        kv_cache_bytes(RECORDED, 0.99)
    grew = MemoryFigures(**{**RECORDED.__dict__, "free_after": RECORDED.init_free + MIB})
    with pytest.raises(RuntimeError, match="another process released device memory"):
        kv_cache_bytes(grew, 0.9)


class FigureLayer:
    """A device layer answering with recorded figures, logging the order of its calls."""

    simulated = False

    def __init__(self, fig: MemoryFigures):
        self.fig, self.log = fig, []

    def empty_cache(self):
        self.log.append("empty_cache")

    def reset_peak_memory_stats(self, device=None):
        self.log.append("reset_peak")

    def synchronize(self, device=None):
        self.log.append("sync")

    def max_memory_allocated(self, device=None):
        self.log.append("peak")
        return self.fig.peak

    def memory_allocated(self, device=None):
        return self.fig.allocated_after

    def mem_get_info(self, device=None):
        self.log.append("mem_get_info")
        return self.fig.free_after, self.fig.total


def test_determine_available_memory_measures_around_the_profiling_step(monkeypatch):
    layer = FigureLayer(RECORDED)
    monkeypatch.setattr(npu, "get", lambda: layer)
    w = object.__new__(DeepInferNPUWorker)
    w.device, w.vllm_config, w.init_free = "npu:0", SimpleNamespace(), RECORDED.init_free
    w.cache_config = SimpleNamespace(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None)
    w.model_runner = SimpleNamespace(profile_run=lambda: layer.log.append("profile"), model_memory_usage=18 * GIB)
    monkeypatch.setattr(npu_worker, "set_current_vllm_config", lambda c: contextlib.nullcontext())
    assert w.determine_available_memory() == 34467112551
    assert layer.log == ["empty_cache", "reset_peak", "profile", "sync", "peak", "empty_cache", "mem_get_info"]
    w.cache_config.kv_cache_memory_bytes = 5 * GIB
    assert w.determine_available_memory() == 5 * GIB


# ------------------------------------------------------------------ warm-up
def test_warm_up_sizes():
    assert warm_up_sizes(8192, 256, 3) == [8192, 1024, 256, 1]
    assert warm_up_sizes(512, 256, 3) == [512, 256, 1]  # drafts capped by the step
    assert warm_up_sizes(2048, 4096, 0) == [2048, 1]


@pytest.mark.parametrize("last_rank", [True, False])
def test_warm_up_runs_every_size_with_attention_and_the_sampler(monkeypatch, last_rank):
    runs = []
    hidden = torch.zeros(256, 8)

    def dummy_run(n, **kw):
        runs.append((n, kw.get("force_attention", False)))
        return torch.zeros(n, 8), hidden

    runner = SimpleNamespace(max_num_tokens=8192, max_num_reqs=256, uniform_decode_query_len=4,
                             _dummy_run=dummy_run, _dummy_sampler_run=lambda hidden_states: runs.append(hidden_states),
                             unmeasured_steps=lambda: contextlib.nullcontext())
    w = object.__new__(DeepInferNPUWorker)
    w.model_runner, w.device = runner, "npu:0"
    w.model_config = SimpleNamespace(seed=0)
    w.parallel_config = SimpleNamespace(data_parallel_index=0)
    w.compilation_config = SimpleNamespace(compilation_time=0.0, encoder_compilation_time=0.0)
    monkeypatch.setattr(npu_worker, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_rank))
    layer = SimpleNamespace(synchronize=lambda d=None: runs.append("sync"))
    monkeypatch.setattr(npu, "get", lambda: layer)
    w.compile_or_warm_up_model()
    steps = [(8192, True), (1024, True), (256, True), (1, True)]
    assert runs[:4] == steps
    if last_rank:
        assert runs[4] == (256, False) and runs[5] is hidden and runs[6:] == ["sync"]
    else:
        assert runs[4:] == ["sync"]


# ------------------------------------------------------------------ load-time OOM
@pytest.mark.parametrize(
    "error",
    [RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 61.27 GiB total capacity)"),
     RuntimeError("call aclrtMalloc failed, error code is 207001")],
    ids=["torch-npu-allocator", "acl"],
)
def test_npu_oom_while_loading_is_vllms_clear_error(monkeypatch, error):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def load(self, *a, **k):
        raise error

    monkeypatch.setattr(GPUModelRunner, "load_model", load)
    runner = object.__new__(DeepInferNPUModelRunner)
    with pytest.raises(torch.OutOfMemoryError, match="not enough NPU memory.*--gpu-memory-utilization") as got:
        runner.load_model()
    assert got.value.__cause__ is error


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("NPU out of memory"), RuntimeError("bad checkpoint")])
def test_other_load_errors_pass_through(monkeypatch, error):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def load(self, *a, **k):
        raise error

    monkeypatch.setattr(GPUModelRunner, "load_model", load)
    with pytest.raises(type(error)) as got:
        object.__new__(DeepInferNPUModelRunner).load_model()
    assert got.value is error  # vLLM's own handler already spoke for torch.OutOfMemoryError


# ------------------------------------------------------------------ timing on the device
def _proposer(adaptive: bool):
    from deepinfer_vllm.configs.dspark import ADDITIONAL_CONFIG_KEY
    from deepinfer_vllm.spec_decode.proposer import DSparkProposer

    cfg = SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: {"num_speculative_tokens": 2, "adaptive": adaptive}},
        model_config=SimpleNamespace(max_model_len=128),
        parallel_config=SimpleNamespace(data_parallel_size=1),
    )
    return DSparkProposer(cfg)


class SlowDevice:
    """A device that finishes queued work only when synchronised (as an NPU's stream does)."""

    def __init__(self, seconds: float):
        self.pending, self.seconds, self.log = 0, seconds, []

    def enqueue(self, tag):
        self.pending += 1
        self.log.append(tag)

    def sync(self):
        self.log.append("sync")
        if self.pending:
            time.sleep(self.seconds * self.pending)
            self.pending = 0


def test_profile_times_device_work_not_enqueueing():
    dev = SlowDevice(0.02)
    p = _proposer(adaptive=True)
    p.profile(lambda n: dev.enqueue(n), 2, dev.sync)
    table = dict(p.verify_costs.table())
    assert set(table) == {1, 2} and min(table.values()) >= 0.02
    # Per size: one unmeasured run, then three measured ones each between two syncs.
    assert dev.log[:9] == [1, "sync", 1, "sync", "sync", 1, "sync", "sync", 1]


def test_unmeasured_steps_stay_out_of_the_cost_table():
    """Profiles and the warm-up run through ``_model_forward`` too; their (cold or self-timed)
    steps must not enter the table that serving steps feed."""
    from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin

    dev = SlowDevice(0.0)

    class Base:
        def _model_forward(self, input_ids=None, positions=None, *a, **k):
            dev.enqueue("forward")

    class Runner(V41RunnerMixin, Base):
        def _sync_device(self):
            dev.sync()

    r = Runner()
    r.drafter, r._v41_step_metadata = _proposer(adaptive=True), {"layer": object()}
    with r.unmeasured_steps():
        r._model_forward(None, torch.zeros(4096, dtype=torch.long))
    assert not r.drafter.verify_costs and dev.log == ["forward"]
    r._model_forward(None, torch.zeros(8, dtype=torch.long))
    assert [n for n, _ in r.drafter.verify_costs.table()] == [8]


@pytest.mark.parametrize("adaptive", [True, False])
def test_target_forward_timing_syncs_only_with_adaptive_verification(adaptive):
    from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin

    dev = SlowDevice(0.02)

    class Base:
        def _model_forward(self, input_ids=None, positions=None, *a, **k):
            dev.enqueue("forward")
            return "out"

    class Runner(V41RunnerMixin, Base):
        def _sync_device(self):
            dev.sync()

    r = Runner()
    r.drafter = _proposer(adaptive)
    r._v41_step_metadata = {"layer": object()}
    assert r._model_forward(None, torch.zeros(5, dtype=torch.long)) == "out"
    if adaptive:
        assert dev.log == ["sync", "forward", "sync"]
        assert r.drafter.verify_costs.table()[0][0] == 5 and r.drafter.verify_costs(5) >= 0.02
    else:
        assert dev.log == ["forward"] and not r.drafter.verify_costs


# ------------------------------------------------------------------ UE8M0 scales as bytes
@pytest.fixture
def ascend_platform(host, monkeypatch):
    """vLLM's ``current_platform`` is DeepInfer's Ascend platform (real-NPU layer, stub torch_npu)."""
    import vllm.platforms

    host(soc="Ascend950PR")
    monkeypatch.setattr(vllm.platforms, "_current_platform", DeepInferAscendPlatform())


def _released_experts(seed: int):
    """Checkpoint tensors of 4 experts (hidden 64, inter 128) as released: int8 E2M1, e8m0 scales."""
    from deepinfer_vllm.ops import quant

    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(4):
        for proj, (rows, cols) in {"w1": (128, 64), "w3": (128, 64), "w2": (64, 128)}.items():
            packed, scale = quant.quant_fp4_rows(torch.randn(rows, cols, generator=g) * 0.2)
            out[e, proj] = (packed.view(torch.int8), scale.view(torch.float8_e8m0fnu))
    return out


def _load_experts(released):
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
    from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts

    mod = RoutedExperts(4, 64, 128, ParallelLayout())
    for (e, proj), (w, s) in released.items():
        mod.load_expert(proj, "weight", e, w)
        mod.load_expert(proj, "scale", e, s)
    return mod


def test_ue8m0_scales_are_held_as_uint8_on_the_npu_with_the_same_numbers(ascend_platform, monkeypatch):
    """Built under the Ascend platform, every UE8M0 parameter is uint8 holding the released
    bytes, and the experts compute what the float8_e8m0fnu-held ones compute, bit for bit."""
    import vllm.platforms

    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
    from deepinfer_vllm.model_executor.layers.v41_engram import EngramTable
    from deepinfer_vllm.model_executor.layers.params import ue8m0_dtype
    from deepinfer_vllm.model_executor.quantization import V41Fp8LinearMethod
    from deepinfer_vllm.ops import quant
    from deepinfer_vllm.ops.moe import route_sqrtsoftplus

    released = _released_experts(seed=5)
    assert ue8m0_dtype() == torch.uint8
    on_npu = _load_experts(released)
    table = EngramTable(16, 64, ParallelLayout())
    fp8 = V41Fp8LinearMethod().params(SimpleNamespace(prefix="x"), 64, 64, (64, 64))
    assert {on_npu.w13_scale.dtype, on_npu.w2_scale.dtype, table.scale.dtype, fp8["scale"].dtype} == {torch.uint8}

    monkeypatch.setattr(vllm.platforms, "_current_platform", SimpleNamespace())  # a platform without a say
    assert ue8m0_dtype() == torch.float8_e8m0fnu
    as_released = _load_experts(released)
    assert as_released.w13_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(on_npu.w13_scale, as_released.w13_scale.view(torch.uint8))
    assert torch.equal(on_npu.w2_scale, as_released.w2_scale.view(torch.uint8))

    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    weights, ids = route_sqrtsoftplus(x, torch.randn(4, 64, generator=g).to(torch.bfloat16), None, 2, 1.5)
    got = on_npu.partial(x, weights, ids, limit=2.0, grouped=False)
    assert torch.equal(got, as_released.partial(x, weights, ids, limit=2.0, grouped=False)) and got.abs().sum() > 0
    rows = torch.randint(0, 255, (16, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(quant.ue8m0_decode(rows), quant.ue8m0_decode(rows.view(torch.float8_e8m0fnu)))


def test_checkpoint_loader_reinterprets_e8m0_into_uint8(ascend_platform):
    """The model's loader copies a released e8m0 tensor into a uint8 parameter byte for byte
    (a numeric conversion would turn 2**k into k-saturated integers)."""
    from deepinfer_vllm.model_executor.layers.params import held, ue8m0_dtype
    from deepinfer_vllm.model_executor.models.deepseek_v41 import DeepseekV41ForCausalLM

    param = held(3, 4, dtype=ue8m0_dtype())
    released = torch.tensor([[0, 1, 126, 127], [128, 130, 200, 254], [3, 5, 7, 9]], dtype=torch.uint8)
    DeepseekV41ForCausalLM._load_param(param, released.view(torch.float8_e8m0fnu))
    assert param.dtype == torch.uint8 and torch.equal(param.data, released)


def test_model_code_imports_no_platform():
    """The scale dtype reaches the model through vLLM's ``current_platform``; no module of
    ``model_executor`` imports DeepInfer's platforms."""
    import pathlib

    import deepinfer_vllm.model_executor as pkg

    root = pathlib.Path(pkg.__file__).parent
    offenders = [
        str(f.relative_to(root)) for f in root.rglob("*.py")
        if "deepinfer_vllm.platforms" in f.read_text() or "from deepinfer_vllm import platforms" in f.read_text()
    ]
    assert offenders == []
