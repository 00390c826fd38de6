"""DSpark settings: validated from vLLM's ``speculative_config`` at config time.

The user writes vLLM's own spelling, ``speculative_config={"method": "dspark",
"num_speculative_tokens": k, "enable_adaptive_verification": ...}``. vLLM 0.32
runs DSpark only in Model Runner V2 (CUDA/ROCm) and refuses both ``dspark`` and
adaptive verification in Model Runner V1, which is the runner of the CPU
platform. The platform therefore records the validated settings in
``additional_config["deepinfer_dspark"]`` and hands vLLM's V1 runner our
proposer through vLLM's documented extension point for proposers
(``method="custom_class"``, ``model=<proposer class path>``); the scheduler,
rejection sampler and spec-decode metrics are vLLM's own. Any parallel layout the
model runs takes DSpark too: with data parallelism every rank takes part in each
draft step's MoE (``spec_decode.proposer``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer_vllm import envs
from deepinfer_vllm.configs import V41Arch

ADDITIONAL_CONFIG_KEY = "deepinfer_dspark"
PROPOSER_CLASS = "deepinfer_vllm.spec_decode.proposer.DSparkProposer"
SUPPORTED_METHODS = ("dspark",)


@dataclass(frozen=True)
class DSparkSettings:
    num_speculative_tokens: int  # k: drafts per step (1 .. dspark_block_size)
    adaptive: bool  # confidence-scheduled verification (docs/design-notes.md, "Adaptive verification")


def dspark_settings(vllm_config) -> DSparkSettings | None:
    """The settings the platform recorded, or None when DSpark is off."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    return DSparkSettings(**raw) if raw else None


def configure_dspark(vllm_config, arch: V41Arch, checkpoint_names: set[str] | None) -> DSparkSettings:
    """Check vLLM's speculative config for V4.1 and switch it to our proposer.

    ``checkpoint_names``: raw tensor names of the checkpoint (None: not readable here, the
    loader checks). Raises ``ValueError`` naming the offending field.
    """
    spec = vllm_config.speculative_config
    method = spec.method
    if method not in SUPPORTED_METHODS and method != "custom_class":
        raise ValueError(
            f"speculative_config.method={method!r}: DeepSeek-V4.1 with deepinfer-vllm drafts with "
            f"DSpark only; use {{'method': 'dspark', 'num_speculative_tokens': k}}"
        )
    if method == "custom_class":
        if spec.model != PROPOSER_CLASS:
            raise ValueError(
                f"speculative_config.model={spec.model!r}: custom proposers are not run for DeepSeek-V4.1; "
                "use {'method': 'dspark'}"
            )
        existing = dspark_settings(vllm_config)
        if existing is None:
            raise ValueError("speculative_config: our proposer class was named without DSpark settings")
        return existing  # already configured (the config is being re-validated)
    if not arch.num_dspark_layers:
        raise ValueError(
            "speculative_config.method='dspark': this checkpoint's config has no DSpark stages "
            "(text_config.num_nextn_predict_layers = 0)"
        )
    if checkpoint_names is not None and not any(n.startswith("mtp.") for n in checkpoint_names):
        raise ValueError(
            "speculative_config.method='dspark': the checkpoint has no mtp.* tensors (DSpark stages); "
            "it was exported without its draft"
        )
    k = spec.num_speculative_tokens
    env_k = envs.dspark_drafts()
    env_name = envs.setting_source("DEEPINFER_DSPARK_DRAFTS")
    if env_k == 0:
        raise ValueError(
            f"speculative_config.method='dspark' but {env_name}=0 switches DSpark off; "
            "unset one of them"
        )
    if env_k is not None and k == arch.dspark_block_size:
        # vLLM's fill-in for an omitted num_speculative_tokens (see envs.py).
        k = env_k
    if not 1 <= k <= arch.dspark_block_size:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={k}"
            + (f" (from {env_name})" if env_k is not None and k == env_k else "")
            + f": DSpark drafts 1 to dspark_block_size ({arch.dspark_block_size}) tokens per step "
            "for this checkpoint"
        )
    if getattr(spec, "dspark_draft_topk", None) is not None:
        raise ValueError("speculative_config.dspark_draft_topk is not supported by deepinfer-vllm's DSpark")
    settings = DSparkSettings(num_speculative_tokens=k, adaptive=bool(spec.enable_adaptive_verification))
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise TypeError("additional_config must be a dict to run DSpark")
    extra[ADDITIONAL_CONFIG_KEY] = asdict(settings)
    spec.num_speculative_tokens = k
    spec.method = "custom_class"
    spec.model = PROPOSER_CLASS
    spec.enable_adaptive_verification = False
    spec.parallel_drafting = False
    return settings
