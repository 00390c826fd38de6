"""The released DeepSeek-V4.1 checkpoint format: names, shapes, dtypes, loading.

One source of truth for what a V4.1 safetensors checkpoint contains (docs/architecture.md,
"Checkpoint tensors"; docs/design-notes.md, "Checkpoint format and loading"): the checkpoint
maker writes exactly ``expected_tensors``, the loader validates headers against it before
reading any data, and ``iter_dequantized`` turns the stored formats into dense tensors.

Names are the raw keys of the release (no ``model.`` prefix, which is accepted
and stripped on read, as DeepInfer does). Storage rules:

* dense linears: FP8 E4M3 ``.weight`` + UE8M0 ``.scale`` per 32x32 tile;
* routed experts: packed FP4 E2M1 in ``I8`` ``[rows, cols/2]`` + UE8M0 per 1x32;
* Engram tables: FP8 rows + UE8M0 per 1x32, handed to the model still encoded;
* fp32: mHC ``hc_*``, ``attn_sink``, gate ``bias``/``bias_vl``, compressor
  ``wkv``/``wgate``, the DSpark confidence head, vision RMSNorm weights;
* bf16: everything else (norms, ``embed``, ``head``, gate weight, indexer
  ``wk``/``weights_proj``, Engram ``q``/``k`` weights, Markov heads, vision).

Where the sources disagree on a dtype the primary dtype below is what the
maker writes and ``alt_dtypes`` are also accepted on load (see each use of
``_ALT_*``): a loader that rejected the real release would be useless, and the
dtypes in question are unverified (docs/architecture.md, "Unverified dtypes").
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.ops import quant

__all__ = [
    "BF16",
    "BLOCK",
    "E8M0",
    "F32",
    "FP4",
    "FP8",
    "INDEX_FILE",
    "DSPARK_PREFIX",
    "dspark_prefix",
    "encode_tensor",
    "STORAGE_DTYPES",
    "VISION_PREFIXES",
    "CheckpointFormatError",
    "TensorSpec",
    "canonical_name",
    "expected_tensors",
    "is_fp32_island",
    "iter_dequantized",
    "read_safetensors_index",
    "safetensors_dtype",
    "scale_name",
    "validate_checkpoint_index",
]

# safetensors dtype strings.
FP8 = "F8_E4M3"
E8M0 = "F8_E8M0"
FP4 = "I8"  # two E2M1 codes per byte, even column in the low nibble
BF16 = "BF16"
F32 = "F32"

BLOCK = 32
INDEX_FILE = "model.safetensors.index.json"

# Unverified dtypes: (primary written by the maker, also accepted).
# Compressor wkv/wgate: fp32 per the training port (NeMo's strict-fp32 list, and
# the reference projects ratio-2 groups in fp32); DeepInfer builds them bf16.
_ALT_COMPRESSOR = (BF16,)
# Confidence head: fp32 per the training port; DeepInfer builds it in the model dtype.
_ALT_CONFIDENCE = (BF16,)
# head.weight: bf16 per DeepInfer (its logits are a bf16 GEMM into fp32); NeMo keeps fp32.
_ALT_HEAD = (F32,)
# image_start/end/newline: bf16 per DeepInfer's container; vLLM allocates fp32.
_ALT_IMAGE = (F32,)
# Vision RMSNorm weights: fp32 per the training port; DeepInfer's tower is bf16.
_ALT_VISION_NORM = (BF16,)

# Name prefixes of the two optional groups: the DSpark stages and the vision tower
# (its ViT, aligner and the image delimiter vectors).
DSPARK_PREFIX = "mtp."


def dspark_prefix(k: int) -> str:
    """Checkpoint and module prefix of DSpark stage ``k``."""
    return f"{DSPARK_PREFIX}{k}"
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")

# Known keys that no implementation uses: allowed, never required,
# and dropped by ``iter_dequantized``.
_UNUSED = {"image_pad"}

_FP32_ISLANDS = re.compile(
    r"(?:^|\.)(?:hc_(?:attn|ffn)_(?:fn|base|scale)"
    r"|attn\.attn_sink"
    r"|ffn\.gate\.bias(?:_vl)?"
    r"|attn\.compressor\.(?:wkv|wgate)\.weight"
    r"|confidence_head\.proj\.weight)$"
)
_ENGRAM_TABLE = re.compile(r"(?:^|\.)engram\.embed\.weight$")


class CheckpointFormatError(ValueError):
    """A checkpoint that does not match the V4.1 format implied by its config.

    ``problems`` lists every finding (the message shows the first 20).
    """

    def __init__(self, message: str, problems: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and safetensors dtype of one stored tensor."""

    shape: tuple[int, ...]
    dtype: str
    # Further dtypes accepted on load where the sources disagree (module docstring).
    alt_dtypes: tuple[str, ...] = ()

    def accepts(self, dtype: str) -> bool:
        return dtype == self.dtype or dtype in self.alt_dtypes

    def describe(self) -> str:
        alts = "".join(f"|{d}" for d in self.alt_dtypes)
        return f"{list(self.shape)} {self.dtype}{alts}"


def scale_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.scale`` (the release's convention for every quantised tensor)."""
    return weight_name.removesuffix(".weight") + ".scale"


def is_fp32_island(name: str) -> bool:
    """Whether a tensor keeps fp32 after loading (docs/architecture.md, "Numerics": mHC, sinks, routing bias,
    compressor projections, confidence head)."""
    return _FP32_ISLANDS.search(name) is not None


def _ceil_blocks(n: int) -> int:
    return -(-n // BLOCK)


class _SpecBuilder:
    """Collects ``TensorSpec`` entries with the release's storage rules."""

    def __init__(self) -> None:
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: str, alt: tuple[str, ...] = ()) -> None:
        if name in self.specs:
            raise AssertionError(f"duplicate tensor {name}")
        self.specs[name] = TensorSpec(tuple(int(s) for s in shape), dtype, alt)

    def fp8(self, prefix: str, rows: int, cols: int) -> None:
        """Dense FP8 linear ``[out, in]`` with one UE8M0 scale per 32x32 tile."""
        self.add(f"{prefix}.weight", (rows, cols), FP8)
        self.add(f"{prefix}.scale", (_ceil_blocks(rows), _ceil_blocks(cols)), E8M0)

    def fp4(self, prefix: str, rows: int, cols: int) -> None:
        """Routed expert: packed E2M1 ``[out, in/2]`` and one UE8M0 scale per 1x32."""
        self.add(f"{prefix}.weight", (rows, cols // 2), FP4)
        self.add(f"{prefix}.scale", (rows, cols // BLOCK), E8M0)

    def fp8_rows(self, prefix: str, rows: int, cols: int) -> None:
        """Engram table: FP8 rows with one UE8M0 scale per 1x32."""
        self.add(f"{prefix}.weight", (rows, cols), FP8)
        self.add(f"{prefix}.scale", (rows, cols // BLOCK), E8M0)


def _block(b: _SpecBuilder, arch: V41Arch, prefix: str, role: LayerRole, n_experts: int) -> None:
    """Every tensor of one transformer block ("Tensors of every layer", "Tensors by layer role")."""
    d, hd, heads = arch.hidden_size, arch.head_dim, arch.num_heads
    mix = arch.hc_mix_dim
    b.add(f"{prefix}.attn_norm.weight", (d,), BF16)
    b.add(f"{prefix}.ffn_norm.weight", (d,), BF16)
    for site in ("attn", "ffn"):
        b.add(f"{prefix}.hc_{site}_fn", (mix, arch.hc_mult * d), F32)
        b.add(f"{prefix}.hc_{site}_base", (mix,), F32)
        b.add(f"{prefix}.hc_{site}_scale", (3,), F32)

    a = f"{prefix}.attn"
    b.fp8(f"{a}.wq_a", arch.q_lora_rank, d)
    b.add(f"{a}.q_norm.weight", (arch.q_lora_rank,), BF16)
    b.fp8(f"{a}.wq_b", heads * hd, arch.q_lora_rank)
    b.fp8(f"{a}.wkv", hd, d)
    b.add(f"{a}.kv_norm.weight", (hd,), BF16)
    b.fp8(f"{a}.wo_a", arch.o_groups * arch.o_lora_rank, heads // arch.o_groups * hd)
    b.fp8(f"{a}.wo_b", d, arch.o_groups * arch.o_lora_rank)
    b.add(f"{a}.attn_sink", (heads,), F32)
    if role.is_kv_source:
        b.add(f"{a}.compressor.wkv.weight", (hd, d), F32, _ALT_COMPRESSOR)
        if role.ratio != 1:  # a single-token group needs no softmax gate
            b.add(f"{a}.compressor.wgate.weight", (hd, d), F32, _ALT_COMPRESSOR)
        b.add(f"{a}.compressor.norm.weight", (hd,), BF16)
        b.add(f"{a}.indexer.wk.weight", (arch.index_head_dim, hd), BF16)
        b.add(f"{a}.indexer.k_norm.weight", (arch.index_head_dim,), BF16)
    if role.is_index_source:
        b.fp8(f"{a}.indexer.wq_b", arch.index_n_heads * arch.index_head_dim, arch.q_lora_rank)
        b.add(f"{a}.indexer.weights_proj.weight", (arch.index_n_heads, d), BF16)

    f, inter = f"{prefix}.ffn", arch.moe_intermediate_size
    b.add(f"{f}.gate.weight", (n_experts, d), BF16)  # spec: bf16 (likely); DeepInfer: bf16
    b.add(f"{f}.gate.bias", (n_experts,), F32)
    b.add(f"{f}.gate.bias_vl", (n_experts,), F32)  # present even in text-only use (NeMo)
    for e in range(n_experts):
        b.fp4(f"{f}.experts.{e}.w1", inter, d)
        b.fp4(f"{f}.experts.{e}.w2", d, inter)
        b.fp4(f"{f}.experts.{e}.w3", inter, d)
    shared = inter * arch.n_shared_experts
    b.fp8(f"{f}.shared_experts.w1", shared, d)
    b.fp8(f"{f}.shared_experts.w2", d, shared)
    b.fp8(f"{f}.shared_experts.w3", shared, d)

    if role.has_engram:
        e = f"{prefix}.engram"
        rows = arch.engram_num_embeddings[arch.engram_layer_ids.index(role.layer_id)]
        b.fp8_rows(f"{e}.embed", rows, arch.engram_head_dim)
        b.fp8(f"{e}.wkv", (arch.hc_mult + 1) * d, arch.engram_n_columns * arch.engram_head_dim)
        b.add(f"{e}.q_weight", (arch.hc_mult, d), BF16)
        b.add(f"{e}.k_weight", (arch.hc_mult, d), BF16)


def _dspark_heads(b: _SpecBuilder, arch: V41Arch) -> None:
    """DSpark's extra tensors: input projection on the first stage, heads on the last."""
    d, rank = arch.hidden_size, arch.dspark_markov_rank
    # mtp.0.main_proj: FP8 + scale (likely; vLLM and DeepInfer build it with the FP8 config).
    b.fp8(f"{dspark_prefix(0)}.main_proj", d, len(arch.dspark_target_layer_ids) * d)
    b.add(f"{dspark_prefix(0)}.main_norm.weight", (d,), BF16)
    last = dspark_prefix(arch.num_dspark_layers - 1)
    b.add(f"{last}.norm.weight", (d,), BF16)
    # Markov heads bf16 (likely; DeepInfer builds them unquantised in bf16).
    b.add(f"{last}.markov_head.embed.weight", (arch.vocab_size, rank), BF16)
    b.add(f"{last}.markov_head.head.weight", (arch.vocab_size, rank), BF16)
    if arch.enable_confidence_head:
        b.add(f"{last}.confidence_head.proj.weight", (1, d + rank), F32, _ALT_CONFIDENCE)


def _vision(b: _SpecBuilder, arch: V41Arch) -> None:
    """ViT, aligner and the image delimiter vectors (docs/architecture.md, "Vision")."""
    d, vd, inter = arch.hidden_size, arch.vision_dim, arch.vision_inter_dim
    for name in ("image_start", "image_end", "image_newline"):
        b.add(name, (d,), BF16, _ALT_IMAGE)
    b.add("vision.patch_embed.proj.weight", (vd, 3 * arch.vision_patch_size**2), BF16)
    b.add("vision.patch_embed.proj.bias", (vd,), BF16)
    for i in range(arch.vision_n_layers):
        p = f"vision.blocks.{i}"
        b.add(f"{p}.norm1.weight", (vd,), F32, _ALT_VISION_NORM)
        b.add(f"{p}.norm2.weight", (vd,), F32, _ALT_VISION_NORM)
        b.add(f"{p}.attn.wqkv.weight", (3 * vd, vd), BF16)
        b.add(f"{p}.attn.wqkv.bias", (3 * vd,), BF16)
        b.add(f"{p}.attn.wo.weight", (vd, vd), BF16)
        b.add(f"{p}.attn.wo.bias", (vd,), BF16)
        b.add(f"{p}.mlp.w1.weight", (2 * inter, vd), BF16)  # gate then up, fused
        b.add(f"{p}.mlp.w2.weight", (vd, inter), BF16)
    b.add("vision.norm.weight", (vd,), F32, _ALT_VISION_NORM)
    merged = vd * arch.vision_downsample_ratio**2
    b.add("aligner.w1.weight", (d, merged), BF16)
    b.add("aligner.w1.bias", (d,), BF16)
    b.add("aligner.w2.weight", (d, d), BF16)
    b.add("aligner.w2.bias", (d,), BF16)


def expected_tensors(
    arch: V41Arch, include_vision: bool = True, include_dspark: bool = True
) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for ``arch`` holds, by raw name.

    Vision tensors exist only when the config has a vision tower and DSpark
    tensors only when it has ``mtp`` layers; the flags drop them further (a
    text-only or draft-free export).
    """
    b = _SpecBuilder()
    d = arch.hidden_size
    b.add("embed.weight", (arch.vocab_size, d), BF16)
    b.add("norm.weight", (d,), BF16)
    b.add("head.weight", (arch.vocab_size, d), BF16, _ALT_HEAD)
    for role in arch.roles:
        _block(b, arch, f"layers.{role.layer_id}", role, arch.n_routed_experts)
    if include_dspark and arch.num_dspark_layers:
        for k, role in enumerate(arch.dspark_roles):
            _block(b, arch, dspark_prefix(k), role, arch.dspark_n_routed_experts)
        _dspark_heads(b, arch)
    if include_vision and arch.has_vision:
        _vision(b, arch)
    return b.specs


# ---------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------

TensorIndex = dict[str, tuple[tuple[int, ...], str]]


def _read_header(path: Path) -> TensorIndex:
    """Names, shapes and dtypes of one safetensors file, without reading data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointFormatError(f"{path}: not a safetensors file (truncated header)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise CheckpointFormatError(f"{path}: implausible safetensors header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise CheckpointFormatError(f"{path}: unreadable safetensors header") from exc
    header.pop("__metadata__", None)
    return {name: (tuple(info["shape"]), info["dtype"]) for name, info in header.items()}


def read_safetensors_index(model_dir: str | Path) -> TensorIndex:
    """``name -> (shape, dtype string)`` for a whole checkpoint, from headers only.

    Sharded checkpoints are read through ``model.safetensors.index.json`` (a
    name listed there must be in its shard); otherwise every ``*.safetensors``
    file of the directory is read, as vLLM would load them all.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    found: TensorIndex = {}
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        headers = {}
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise CheckpointFormatError(f"{index_path.name} names missing shard {shard!r}")
            headers[shard] = _read_header(model_dir / shard)
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise CheckpointFormatError(f"tensor {name!r} is indexed in {shard!r} but not stored there")
        files = [(shard, headers[shard]) for shard in shards]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise CheckpointFormatError(f"no *.safetensors files in {model_dir}")
        files = [(p.name, _read_header(p)) for p in paths]
    owner: dict[str, str] = {}
    for file_name, header in files:
        for name, entry in header.items():
            if name in owner:
                raise CheckpointFormatError(
                    f"tensor {name!r} is stored in both {owner[name]!r} and {file_name!r}"
                )
            owner[name] = file_name
            found[name] = entry
    return found


def canonical_name(name: str) -> str:
    """A stored name without the optional ``model.`` prefix (DeepInfer accepts both)."""
    return name.removeprefix("model.")


_SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: FP8,
    torch.float8_e8m0fnu: E8M0,
    torch.int8: FP4,
    torch.uint8: "U8",
    torch.bfloat16: BF16,
    torch.float16: "F16",
    torch.float32: F32,
    torch.float64: "F64",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a loaded tensor (as its header spells it)."""
    return _SAFETENSORS_DTYPES.get(dtype, str(dtype))


def _detect(found_canonical: Iterable[str]) -> tuple[bool, bool]:
    """Whether a checkpoint carries the vision tower / the DSpark stages at all."""
    vision = mtp = False
    for name in found_canonical:
        vision |= name.startswith(VISION_PREFIXES)
        mtp |= name.startswith(DSPARK_PREFIX)
    return vision, mtp


def validate_checkpoint_index(
    arch: V41Arch,
    found: Mapping[str, tuple[tuple[int, ...], str]],
    include_vision: bool | None = None,
    include_dspark: bool | None = None,
) -> None:
    """Check a header index against the format implied by ``arch``.

    Raises ``CheckpointFormatError`` listing every missing, unknown, mis-shaped
    or mis-typed tensor by its name in the checkpoint. The vision and DSpark
    groups are all-or-nothing; ``None`` means "required if any of it is present".
    """
    by_canonical: dict[str, str] = {}
    for raw in found:
        canon = canonical_name(raw)
        if canon in by_canonical:
            raise CheckpointFormatError(
                f"tensor {raw!r} is stored twice (with and without the 'model.' prefix)"
            )
        by_canonical[canon] = raw
    has_vision, has_dspark = _detect(by_canonical)
    expected = expected_tensors(
        arch,
        include_vision=has_vision if include_vision is None else include_vision,
        include_dspark=has_dspark if include_dspark is None else include_dspark,
    )
    problems: list[str] = []
    for name, spec in expected.items():
        if name not in by_canonical:
            problems.append(f"missing tensor {name!r} (expected {spec.describe()})")
    for canon, raw in by_canonical.items():
        shape, dtype = tuple(found[raw][0]), found[raw][1]
        spec = expected.get(canon)
        if spec is None:
            if canon in _UNUSED and shape == (arch.hidden_size,) and dtype in (BF16, F32):
                continue
            problems.append(
                f"unknown tensor {raw!r} ({list(shape)} {dtype}) is not part of this config's format"
            )
        elif shape != spec.shape:
            problems.append(f"tensor {raw!r} has shape {list(shape)}, expected {spec.describe()}")
        elif not spec.accepts(dtype):
            problems.append(f"tensor {raw!r} has dtype {dtype}, expected {spec.describe()}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointFormatError(
            f"checkpoint does not match the DeepSeek-V4.1 format ({len(problems)} problem(s)):\n  {shown}{more}",
            problems,
        )


# ---------------------------------------------------------------------------
# Dequantising iterator
# ---------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte storage tensor viewed as uint8 (lossless; never a numeric cast)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise CheckpointFormatError(f"expected a one-byte tensor, got {t.dtype}")
    return t.view(torch.uint8)


def iter_dequantized(
    arch: V41Arch,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, dense tensor)`` from raw checkpoint tensors in any order.

    * FP8 linears and FP4 experts are paired with their ``.scale`` (buffered
      until both arrived) and yielded once, dequantised to ``dtype``, under the
      ``.weight`` name;
    * Engram tables stay encoded: ``...engram.embed.weight`` (uint8 E4M3 codes)
      and ``...engram.embed.scale`` (uint8 UE8M0) are yielded as a pair, so the
      model dequantises only the rows it looks up;
    * other tensors are cast to ``dtype``, except the fp32 islands
      (``is_fp32_island``), which stay fp32.
    A ``model.`` prefix is stripped. Unknown names and weights or scales left
    without their partner at the end raise ``CheckpointFormatError``.
    """
    specs = expected_tensors(arch)
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def emit(weight_name: str, w: torch.Tensor, s: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        spec_w, spec_s = specs[weight_name], specs[scale_name(weight_name)]
        for name, t, spec in ((weight_name, w, spec_w), (scale_name(weight_name), s, spec_s)):
            if tuple(t.shape) != spec.shape:
                raise CheckpointFormatError(
                    f"tensor {name!r} has shape {list(t.shape)}, expected {spec.describe()}"
                )
        if _ENGRAM_TABLE.search(weight_name):
            yield weight_name, _bytes(w)
            yield scale_name(weight_name), _bytes(s)
        elif spec_w.dtype == FP4:
            yield weight_name, quant.dequant_fp4_rows(_bytes(w), _bytes(s), dtype)
        else:
            yield weight_name, quant.dequant_fp8_block(_bytes(w), _bytes(s), BLOCK, dtype)

    for raw_name, tensor in named_tensors:
        name = canonical_name(raw_name)
        spec = specs.get(name)
        if spec is None:
            if name in _UNUSED:
                continue
            raise CheckpointFormatError(f"unknown tensor {raw_name!r} is not part of this config's format")
        if name.endswith(".scale") and spec.dtype == E8M0:
            weight_name = name.removesuffix(".scale") + ".weight"
            if weight_name in weights:
                yield from emit(weight_name, weights.pop(weight_name), tensor)
            else:
                scales[name] = tensor
        elif spec.dtype in (FP8, FP4):
            if scale_name(name) in scales:
                yield from emit(name, tensor, scales.pop(scale_name(name)))
            else:
                weights[name] = tensor
        elif is_fp32_island(name):
            yield name, tensor.float()
        else:
            yield name, tensor.to(dtype)
    orphans = sorted(weights) + sorted(scales)
    if orphans:
        raise CheckpointFormatError(
            f"quantised tensors without their partner (weight/scale): {orphans[:10]}"
            + (f" ... and {len(orphans) - 10} more" if len(orphans) > 10 else "")
        )


# Storage dtypes of the unquantised tensors.
STORAGE_DTYPES = {F32: torch.float32, BF16: torch.bfloat16}


def encode_tensor(name: str, dense: torch.Tensor, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """fp32 values of tensor ``name`` in its storage format: the tensor, plus its UE8M0
    scale for FP8 / FP4 weights (``specs``: ``expected_tensors``). The encoder of the format
    this module describes: checkpoints the tools write, and DSpark drafts they train."""
    spec = specs[name]
    if spec.dtype == FP4:
        codes, scale = quant.quant_fp4_rows(dense)
        stored = codes.view(torch.int8)
    elif spec.dtype == FP8:
        if name.endswith("engram.embed.weight"):
            codes, scale = quant.quant_fp8_rows(dense)
        else:
            codes, scale = quant.quant_fp8_block(dense, BLOCK)
        stored = codes.view(torch.float8_e4m3fn)
    else:
        return {name: dense.to(STORAGE_DTYPES[spec.dtype])}
    sname = scale_name(name)
    if tuple(scale.shape) != specs[sname].shape:
        raise AssertionError(f"{sname}: quantiser gave {tuple(scale.shape)}, format says {specs[sname].shape}")
    return {name: stored, sname: scale.view(torch.float8_e8m0fnu)}
