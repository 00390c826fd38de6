"""Write a random-weight DeepSeek-V4.1 checkpoint in the released format.

Every tensor of ``checkpoint.expected_tensors`` is written with its real
storage format (FP8 + 32x32 UE8M0 tiles, packed FP4 experts, FP8 Engram rows,
bf16/fp32 elsewhere), quantised by ``ops.quant``, next to ``config.json`` in
the released nesting, ``generation_config.json`` and an offline tokenizer.

Weights follow the hygiene of docs/architecture.md, "Tiny tensor shapes", and keep
activations O(1) through the stack: linears draw N(0, 1/fan_in) before quantisation (so FP8/FP4 dequantise
to std ~ 1/sqrt(fan_in)), norms are 1, mHC scales 0.1..1 with bases near 0,
sinks near 0, gate biases small and random, Engram rows and embeddings O(1).
Each tensor has its own generator seeded from (seed, name): output is
byte-identical for a seed and independent of the tensor order.

Usage::

    python -m deepinfer_vllm.tools.make_checkpoint --preset tiny --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer

from deepinfer_vllm.configs import ConfigError, DeepseekV41Config, V41Arch
from deepinfer_vllm.configs import checkpoint as ckpt
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.engram import compressed_vocab_from_tokenizer, engram_primes
from deepinfer_vllm.tools.threads import one_thread
from deepinfer_vllm.tools.presets import PRESETS, TRAINED_DRAFT_PRESETS, WEIGHT_PRESETS, get_preset
from deepinfer_vllm.tools.tokenizer_builder import (
    build_v41_tokenizer,
    build_wordlevel_tokenizer,
    save_tokenizer,
)

__all__ = ["main", "make_checkpoint", "random_tensors", "resolve_config"]

# Top-level keys of the released config.json ("Config nesting"); anything else that a
# flat or Transformers-serialised input carries is dropped.
_RELEASED_TOP_LEVEL = (
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "tie_word_embeddings",
    "quantization_config",
    "text_config",
    "vision_config",
)

_NORM = re.compile(r"(?:^|\.|_)norm\d?\.weight$")


def _released_layout(config: Mapping[str, Any]) -> dict[str, Any]:
    """Any accepted config form -> the released nesting (a fresh copy)."""
    if not isinstance(config.get("text_config"), Mapping):
        config = DeepseekV41Config(**copy.deepcopy(dict(config))).to_dict()
    return {k: copy.deepcopy(config[k]) for k in _RELEASED_TOP_LEVEL if k in config}


def _engram_rows(text: Mapping[str, Any]) -> list[int]:
    """Table rows per Engram layer: the sum of its primes (docs/architecture.md, "Prime tables")."""
    primes = engram_primes(
        text["engram_layer_ids"],
        text["engram_max_ngram_size"],
        text["engram_n_heads"],
        text["engram_vocab_size"],
    )
    return [sum(sum(per_order) for per_order in primes[layer]) for layer in text["engram_layer_ids"]]


def _build_tokenizer(kind: str, vocab_size: int) -> Tokenizer:
    if kind == "v41":
        return build_v41_tokenizer(vocab_size)
    if kind == "wordlevel":
        return build_wordlevel_tokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'v41' or 'wordlevel'")


def resolve_config(
    preset: str | None = None,
    config: Mapping[str, Any] | None = None,
    tokenizer: Tokenizer | None = None,
    include_vision: bool = True,
    include_dspark: bool = True,
) -> dict[str, Any]:
    """The config.json a checkpoint will carry: preset or given config, with the
    vision/DSpark switches applied and the tokenizer-derived Engram fields set."""
    cfg = _released_layout(config) if config is not None else get_preset(preset or "tiny")
    text = cfg["text_config"]
    n_layers = text["num_hidden_layers"]
    if not include_vision:
        cfg["vision_config"] = {**cfg.get("vision_config", {}), "num_hidden_layers": 0}
    if not include_dspark:
        text.pop("n_dspark_layers", None)
        text["num_nextn_predict_layers"] = 0
        text["compress_ratios"] = list(text["compress_ratios"][:n_layers])
    if text.get("engram_layer_ids"):
        rows = _engram_rows(text)
        given = text.get("engram_num_embeddings")
        if given and list(given) != rows:
            raise ConfigError(
                "text_config.engram_num_embeddings",
                f"{list(given)} != the prime-table sizes {rows}",
            )
        text["engram_num_embeddings"] = rows
        if tokenizer is not None:
            _, classes = compressed_vocab_from_tokenizer(tokenizer, text["vocab_size"])
            text["engram_compressed_vocab_size"] = classes
    return cfg


def _tensor_seed(seed: int, name: str) -> int:
    """32 bits from (seed, name): torch's CPU generator keeps only the low 32 bits of a seed."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _dense_value(name: str, shape: tuple[int, ...], arch: V41Arch, g: torch.Generator) -> torch.Tensor:
    """fp32 values of a tensor before quantisation / storage (see the module docstring)."""

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    if _NORM.search(name):
        return torch.ones(shape)
    if re.search(r"hc_(?:attn|ffn)_fn$", name):
        return normal(shape[1] ** -0.5)  # mix logits O(1) for unit-RMS streams
    if re.search(r"hc_(?:attn|ffn)_base$", name):
        return normal(0.1)
    if re.search(r"hc_(?:attn|ffn)_scale$", name):
        return 0.1 + 0.9 * torch.rand(shape, generator=g)
    if name.endswith("attn.attn_sink"):
        return normal(0.01)
    if re.search(r"ffn\.gate\.bias(?:_vl)?$", name):
        return normal(0.05)  # steers some top-k choices, not all
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1.0 + normal(0.1)
    if name in ("embed.weight", "image_start", "image_end", "image_newline") or name.endswith(
        ("engram.embed.weight", "markov_head.embed.weight")
    ):
        return normal(1.0)
    if name.endswith(".bias"):
        return normal(0.02)
    # Linear weight [out, in]: std 1/sqrt(fan_in) keeps outputs O(1).
    return normal(shape[-1] ** -0.5)


def random_tensors(
    arch: V41Arch, seed: int = 0, include_vision: bool = True, include_dspark: bool = True
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of ``arch`` in its storage dtype, deterministically."""
    with one_thread():
        return _random_tensors(arch, seed, include_vision, include_dspark)


def _random_tensors(
    arch: V41Arch, seed: int, include_vision: bool, include_dspark: bool
) -> dict[str, torch.Tensor]:
    specs = ckpt.expected_tensors(arch, include_vision=include_vision, include_dspark=include_dspark)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.dtype == ckpt.E8M0:
            continue  # written together with its weight
        g = torch.Generator().manual_seed(_tensor_seed(seed, name))
        shape = (spec.shape[0], 2 * spec.shape[1]) if spec.dtype == ckpt.FP4 else spec.shape
        out.update(ckpt.encode_tensor(name, _dense_value(name, shape, arch, g), specs))
    return out


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def make_checkpoint(
    out_dir: str | Path,
    preset: str | None = None,
    config: Mapping[str, Any] | None = None,
    seed: int = 0,
    tokenizer: str = "v41",
    include_vision: bool = True,
    include_dspark: bool = True,
    config_only: bool = False,
    draft_steps: int | None = None,
) -> Path:
    """Write a complete random-weight checkpoint directory and return its path.

    ``config`` (nested or flat config.json dict) takes precedence over
    ``preset`` (default ``tiny``). ``include_vision=False`` / ``include_dspark=False``
    also switch the tower / DSpark stages off in the written config, so the
    directory is self-consistent. ``draft_steps``: training steps of a trained-draft
    preset's draft (default: ``train_dspark.Recipe``'s, the documented recipe).
    """
    out = Path(out_dir)
    if config_only:
        return write_config(out, preset=preset, config=config)
    if config is None and (preset or "tiny") not in WEIGHT_PRESETS:
        raise ValueError(
            f"preset {preset!r} is the released size; its weights are not generated here. "
            "Write its config.json alone with config_only=True (--config-only)."
        )
    out.mkdir(parents=True, exist_ok=True)
    base = _released_layout(config) if config is not None else get_preset(preset or "tiny")
    tok = _build_tokenizer(tokenizer, base["text_config"]["vocab_size"])
    cfg = resolve_config(config=base, tokenizer=tok, include_vision=include_vision, include_dspark=include_dspark)
    arch = V41Arch.from_config(cfg)

    # Weights left by an earlier run would be loaded alongside the new ones.
    for stale in [*out.glob("*.safetensors"), out / ckpt.INDEX_FILE]:
        stale.unlink(missing_ok=True)
    save_file(random_tensors(arch, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tok, out, arch.max_position_embeddings)
    if config is None and preset in TRAINED_DRAFT_PRESETS:
        # The draft is trained on the target just written (config.json first: the
        # reference loads the directory), then config.json is written again last.
        _write_generation_and_config(out, arch, cfg)
        from deepinfer_vllm.tools.train_dspark import Recipe, train_draft

        recipe = Recipe(seed=seed) if draft_steps is None else Recipe(seed=seed, steps=draft_steps)
        train_draft(out, recipe, log=lambda line: print(line, file=sys.stderr))
    _write_generation_and_config(out, arch, cfg)
    return out


def _write_generation_and_config(out: Path, arch: V41Arch, cfg: Mapping[str, Any]) -> None:
    generation = {
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "pad_token_id": arch.pad_token_id,
    }
    _write_json(out / "generation_config.json", generation)
    # config.json last: its presence marks a complete directory (make targets).
    # Transformers treats a local config.json without a version as a possibly
    # old Mistral export and warns about its tokenizer; say who wrote it.
    _write_json(out / "config.json", {**cfg, "transformers_version": transformers.__version__})


def write_config(
    out_dir: str | Path, preset: str | None = None, config: Mapping[str, Any] | None = None
) -> Path:
    """Write only ``config.json`` and ``generation_config.json`` (no weights, no
    tokenizer): enough for sizing tools such as ``deepinfer-memory-plan``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _released_layout(config) if config is not None else get_preset(preset or "tiny")
    arch = V41Arch.from_config(cfg)
    _write_generation_and_config(out, arch, cfg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``deepinfer-make-checkpoint`` console entry point."""
    parser = argparse.ArgumentParser(
        prog="deepinfer-make-checkpoint",
        description="Write a random-weight DeepSeek-V4.1 checkpoint in the released format.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--config", help="config.json (nested or flat) to use instead of --preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=("v41", "wordlevel"), default="v41")
    parser.add_argument(
        "--no-vision", action="store_true", help="no vision tower (vision_config.num_hidden_layers = 0)"
    )
    parser.add_argument(
        "--no-dspark",
        "--no-mtp",  # the release's name for the stages' tensors (mtp.*); kept as an alias
        dest="no_dspark",
        action="store_true",
        help="no DSpark stages (num_nextn_predict_layers = 0)",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json alone (the only choice for --preset flash)",
    )
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text()) if args.config else None
    if args.config_only:
        path = write_config(args.out, preset=args.preset, config=config)
        print(f"wrote {path / 'config.json'}", file=sys.stderr)
        return 0
    if config is None and args.preset not in WEIGHT_PRESETS:
        parser.error(f"--preset {args.preset} is the released size; add --config-only for its config.json")
    path = make_checkpoint(
        args.out,
        preset=args.preset,
        config=config,
        seed=args.seed,
        tokenizer=args.tokenizer,
        include_vision=not args.no_vision,
        include_dspark=not args.no_dspark,
    )
    n = len(ckpt.read_safetensors_index(path))
    print(f"wrote {n} tensors to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
