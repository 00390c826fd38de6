"""Every ``DEEPINFER_*`` setting of the plugin, in one place.

Read lazily (at call time), so a variable set after import still counts and
the plugin stays cheap to import in every vLLM process.

| Variable | Default | Meaning |
| --- | --- | --- |
| ``DEEPINFER_PREFILL_TRUNCATION_MODE`` | unset: ``compact`` with vLLM's ``swa_bounded_replay`` on (its default), ``off`` with ``--no-swa-bounded-replay`` | DeepInfer's prefill truncation of the decoder half (the causal decoder, from the first ratio-1 layer). ``off``: every layer runs every prompt row. ``mask``: decoder layers keep window KV only for the last ``KEEP`` prompt positions and clip their window there. ``compact``: the same numerics (bit for bit), computing decoder layers only on the kept rows. Requests asking for prompt logprobs always keep every row. vLLM's flag also keeps window KV out of the prefix cache (a hit replays its last window); this variable chooses the decoder half alone. |
| ``DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS`` | ``0`` (= ``sliding_window + 12`` when truncating) | retained suffix ``KEEP``; must be at least ``sliding_window``. |
| ``DEEPINFER_PLATFORM`` | ``auto`` | ``auto``: activate DeepInfer's platform where it must run (CPU-only hosts with vLLM's CPU build). ``off``: never activate it (stock vLLM platforms). ``ascend``: DeepInfer's Ascend platform on any Ascend SoC with torch-npu (in ``auto`` only an Ascend 950 gets it); with vllm-ascend installed, also exclude its ``ascend`` entry through ``VLLM_PLUGINS`` (vLLM activates one out-of-tree platform). |
| ``DEEPINFER_MODEL`` | ``auto`` | which class serves ``DeepseekV41ForCausalLM``. ``deepinfer``: this plugin's (released formats held as released, TP/DP/EP through vLLM's groups). ``vllm``: vLLM's in-tree class (the plugin registers no model; its serving fixes in ``entrypoints/`` still apply). ``auto``: vLLM's on CUDA and ROCm, where the in-tree class runs the release on the GPU; the plugin's everywhere else (vLLM's is GPU-only). The choice is logged. |
| ``DEEPINFER_DSPARK_DRAFTS`` | unset | DeepInfer's DSpark draft width ``k``: used where vLLM's ``speculative_config`` leaves ``num_speculative_tokens`` to its default. vLLM 0.32 accepts that only when the config names the draft ``model`` (for DSpark, the checkpoint itself) and then fills in ``dspark_block_size``; with this variable set, the platform uses its value instead (an explicit ``num_speculative_tokens`` equal to ``dspark_block_size`` cannot be told apart and yields too). ``0`` refuses DSpark. |
| ``DEEPINFER_GEMM_KERNELS`` | ``auto`` | kernels of the weight GEMMs (FP8 32x32 dense layers, grouped packed-E2M1 experts). ``auto``: our Triton kernels on CUDA devices for bf16 models (dense FP8 from 1024 rows: the weight decoded to bf16 by a Triton kernel, the product on cuBLAS); the PyTorch reference elsewhere (fp32 models keep it everywhere: it accumulates in fp64; so does ``DEEPINFER_BATCH_INVARIANT=1``: the kernels' tiles depend on the number of rows). ``torch`` / ``triton`` force one (``triton`` needs bf16 activations; on a CPU only under ``TRITON_INTERPRET=1``). The MoE's Triton path groups tokens by expert on the device, without host synchronisation. Read when the model is built; the choice is logged once. |
| ``DEEPINFER_GEMM_ACTIVATIONS`` | ``bf16`` | what the weight GEMMs multiply the FP8 / FP4 weights with. ``bf16``: the activations as computed (the reference numerics). ``mxfp8``: activations first quantised to MXFP8 (e4m3 + UE8M0 per 32 along K), as DeepInfer does on the GPU; the same on every path, so kernels and reference agree. Read when the model is built. |
| ``DEEPINFER_FUSED_KERNELS`` | ``auto`` | kernels of the per-token chains between the GEMMs: the hyper-connection sites (mix coefficients with the Sinkhorn loop, collapse + RMSNorm, expand: about 150 small PyTorch kernels per site, four Triton launches), RMSNorm and RoPE (one launch each instead of about 7 and 12). ``auto``: Triton on CUDA devices for bf16 models; on NPU devices for bf16 models, RMSNorm and RoPE on ``torch_npu``'s fused operators (``npu_rms_norm``, ``npu_rotary_mul``; ``ops/npu.py``, never run on an NPU) with the mHC sites on the reference; the PyTorch reference elsewhere (fp32 models keep it everywhere). ``torch`` / ``triton`` / ``npu`` force one (``triton``: on a CPU only under ``TRITON_INTERPRET=1``; ``npu`` needs ``torch_npu``). Both compute in fp32 and give every row independently of the batch; they differ in summation order, FMA contraction and the exponential's last bits. Read when the model is built; the choice is logged once. |
| ``DEEPINFER_ATTENTION_KERNELS`` | ``auto`` | kernels of the attention hot path (cache writes, indexer + top-k, sparse attention). ``auto``: our Triton kernels on CUDA devices, the PyTorch reference elsewhere. ``torch``: always the reference. ``triton``: always Triton (on a CPU only under ``TRITON_INTERPRET=1``, for tests). Read when the model is built; the choice is logged once. |
| ``DEEPINFER_BATCH_INVARIANT`` | ``0`` | ``1``: every row of a step is computed independently of the other rows (requests, prefill chunks, decodes) sharing it, so a request's tokens and logprobs are bitwise the same alone and in any batch, in bf16 and fp32 (greedy and seeded sampling). GEMMs run in fixed row tiles (``ops.numerics.matmul``) and sigmoid / SiLU / softplus on the scalar kernel (``ops.numerics.pointwise``); numerics stay those of docs/architecture.md, "Numerics" (last-ulp differences from ``0``). Costs throughput (``benchmarks/README.md``). ``0``: the fastest kernel for each call. |
| ``DEEPINFER_GRAMMAR_MAX_WHITESPACE`` | ``16`` | longest whitespace run a V4.1 JSON or tool-call grammar allows (xgrammar's ``max_whitespace_cnt``) where vLLM allows whitespace at all (its ``disable_any_whitespace`` off); without a cap a model can fill ``max_tokens`` with blanks. See ``patch/structured_outputs.py``. |
| ``DEEPINFER_SIMULATED_NPU`` | ``0`` | TEST ONLY, never on by default. ``1``: DeepInfer's Ascend platform, worker and runner run on CPU tensors with the device layer (``platforms/ascend/device.py``) replaced by its ``SimulatedNPU`` stub, so the Ascend path is exercised on hosts without an NPU; vLLM logs the Ascend platform as on a 950. Never set it on a real NPU host. |

Older names still work, with a deprecation line in the log (once per process):
``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``, ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` (prefill
truncation) and ``DEEPINFER_USE_NEXTN_DECODE`` (DSpark's draft width).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# Prefill truncation's modes (``DEEPINFER_PREFILL_TRUNCATION_MODE``, table above).
TRUNCATION_MODES = ("off", "mask", "compact")

# Current name -> the name it replaced (read when the current one is unset).
DEPRECATED_NAMES = {
    "DEEPINFER_PREFILL_TRUNCATION_MODE": "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
    "DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS": "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
    "DEEPINFER_DSPARK_DRAFTS": "DEEPINFER_USE_NEXTN_DECODE",
}
_warned: set[str] = set()


def setting_source(name: str) -> str:
    """The variable that holds ``name``'s setting: ``name``, or its deprecated older name
    when only that one is set (logged once)."""
    old = DEPRECATED_NAMES.get(name)
    if old is None or name in os.environ or old not in os.environ:
        return name
    if old not in _warned:
        _warned.add(old)
        logger.warning("%s is deprecated; set %s instead (same values)", old, name)
    return old


def _get(name: str, default: str) -> str:
    return os.environ.get(setting_source(name), default).strip()


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """``name``'s value (default: the first choice), lower-cased; anything else raises."""
    value = _get(name, choices[0]).lower()
    if value not in choices:
        raise ValueError(f"{setting_source(name)}={value!r}; expected one of {choices}")
    return value


def prefill_truncation_mode(default: str = "off") -> str:
    """``DEEPINFER_PREFILL_TRUNCATION_MODE``, or ``default`` when it is unset (the model passes the
    mode vLLM's ``swa_bounded_replay`` implies)."""
    name = setting_source("DEEPINFER_PREFILL_TRUNCATION_MODE")
    if not os.environ.get(name, "").strip():
        return default
    return _choice("DEEPINFER_PREFILL_TRUNCATION_MODE", TRUNCATION_MODES)


def _int(name: str, default: int, minimum: int) -> int:
    raw = _get(name, str(default))
    name = setting_source(name)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def prefill_truncation_keep() -> int:
    return _int("DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS", 0, minimum=0)


def prefill_truncation_settings(sliding_window: int, default_mode: str = "off") -> tuple[str, int]:
    """``(mode, keep)`` validated against the model's window; ``default_mode`` applies when the
    mode variable is unset."""
    mode = prefill_truncation_mode(default_mode)
    keep = prefill_truncation_keep()
    if mode == "off":
        return mode, 0
    if keep == 0:
        # DeepInfer ships KEEP = W + 12 (= 140 for Flash's 128-token window).
        keep = sliding_window + 12
    if keep < sliding_window:
        raise ValueError(
            f"{setting_source('DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS')}={keep} is below the sliding window "
            f"({sliding_window}); decode would read window KV that was never written."
        )
    return mode, keep


def platform_mode() -> str:
    return _choice("DEEPINFER_PLATFORM", ("auto", "off", "ascend"))


ATTENTION_KERNEL_MODES = ("auto", "torch", "triton")


def attention_kernels() -> str:
    return _choice("DEEPINFER_ATTENTION_KERNELS", ATTENTION_KERNEL_MODES)


GEMM_KERNEL_MODES = ("auto", "torch", "triton")
GEMM_ACTIVATIONS = ("bf16", "mxfp8")


FUSED_KERNEL_MODES = ("auto", "torch", "triton", "npu")


def fused_kernels() -> str:
    return _choice("DEEPINFER_FUSED_KERNELS", FUSED_KERNEL_MODES)


def gemm_kernels() -> str:
    return _choice("DEEPINFER_GEMM_KERNELS", GEMM_KERNEL_MODES)


def gemm_activations() -> str:
    """``DEEPINFER_GEMM_ACTIVATIONS``; read when a weight GEMM operator is built."""
    return _choice("DEEPINFER_GEMM_ACTIVATIONS", GEMM_ACTIVATIONS)


def batch_invariant() -> bool:
    """``DEEPINFER_BATCH_INVARIANT``: ``1`` on, ``0`` (default) off. Read when the weight GEMMs'
    kernels are chosen, and on every call of ``ops.numerics.matmul`` / ``pointwise`` (one
    environment lookup)."""
    return _choice("DEEPINFER_BATCH_INVARIANT", ("0", "1")) == "1"


def dspark_drafts() -> int | None:
    """``DEEPINFER_DSPARK_DRAFTS`` as an int, or None when unset."""
    raw = _get("DEEPINFER_DSPARK_DRAFTS", "")
    if not raw:
        return None
    name = setting_source("DEEPINFER_DSPARK_DRAFTS")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}; expected a draft count (int >= 0)") from None
    if value < 0:
        raise ValueError(f"{name}={value}; expected a draft count (int >= 0)")
    return value


MODEL_CHOICES = ("auto", "deepinfer", "vllm")


def model_choice() -> str:
    return _choice("DEEPINFER_MODEL", MODEL_CHOICES)


def grammar_max_whitespace() -> int:
    return _int("DEEPINFER_GRAMMAR_MAX_WHITESPACE", 16, minimum=1)


def simulated_npu() -> bool:
    """``DEEPINFER_SIMULATED_NPU`` (test only): ``1`` on, ``0`` (default) off."""
    return _choice("DEEPINFER_SIMULATED_NPU", ("0", "1")) == "1"
