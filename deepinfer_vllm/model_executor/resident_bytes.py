"""Resident weight bytes of a loaded V4.1 model, per component, beside the checkpoint's.

For every parameter the model holds, the resident side counts its bytes
(each storage once) and the checkpoint side counts the bytes the same
elements occupy in the checkpoint (the element size of the tensor it was
loaded from, recorded at load; vocabulary padding rows excluded; with expert
load balancing, each logical expert a rank holds counts once however many
slots replicate it, so redundant experts show as a ratio above 1). Buffers
that are not weights (rope tables) are counted as resident ``other``. A
ratio above 1 means weights were widened or copied at load.
"""

from __future__ import annotations

import torch

from deepinfer_vllm.configs import checkpoint

__all__ = ["COMPONENTS", "component_of", "format_report", "weight_bytes"]

COMPONENTS = ("experts", "engram", "dense", "embedding_head", "dspark", "vision", "other")


def component_of(name: str) -> str:
    """The report's component of a parameter (or checkpoint tensor) name."""
    name = checkpoint.canonical_name(name)
    if name.startswith(checkpoint.DSPARK_PREFIX):
        return "dspark"
    if name.startswith(checkpoint.VISION_PREFIXES):
        return "vision"
    if ".ffn.experts." in name:
        return "experts"
    if ".engram.embed." in name:
        return "engram"
    if name.startswith(("embed.", "head.")):
        return "embedding_head"
    return "dense"


def _held_rows(model: torch.nn.Module, name: str, param: torch.Tensor) -> int:
    """Elements of ``param`` that hold checkpoint values (vocab shards pad their tail)."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if getattr(module, "balanced", False):  # RoutedExperts' slots: distinct experts only
        held = module.physical_to_logical[module.local.start : module.local.stop]
        return len(set(held.tolist())) * (param.numel() // param.shape[0])
    shard = getattr(module, "shard_indices", None)
    if shard is None:
        return param.numel()
    rows = shard.org_vocab_end_index - shard.org_vocab_start_index
    return rows * (param.numel() // param.shape[0])


def weight_bytes(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """``{component: {"resident": bytes, "checkpoint": bytes}}`` plus a ``total`` row."""
    sizes: dict[str, int] = getattr(model, "checkpoint_element_size", {})
    rows = {c: {"resident": 0, "checkpoint": 0} for c in COMPONENTS}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        ptr = param.untyped_storage().data_ptr()
        comp = component_of(name)
        if ptr not in seen or param.numel() == 0:
            seen.add(ptr)
            rows[comp]["resident"] += param.numel() * param.element_size()
        if name not in sizes:
            raise KeyError(f"parameter {name!r} was not loaded from the checkpoint")
        rows[comp]["checkpoint"] += _held_rows(model, name, param) * sizes[name]
    for _, buf in model.named_buffers():
        ptr = buf.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            rows["other"]["resident"] += buf.numel() * buf.element_size()
    rows["total"] = {k: sum(r[k] for r in rows.values()) for k in ("resident", "checkpoint")}
    return rows


def format_report(rows: dict[str, dict[str, int]], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'component':<16} {'resident B':>14} {'checkpoint B':>14} {'ratio':>7}")
    for comp, r in rows.items():
        if comp != "total" and not (r["resident"] or r["checkpoint"]):
            continue
        ratio = f"{r['resident'] / r['checkpoint']:.3f}" if r["checkpoint"] else "-"
        lines.append(f"{comp:<16} {r['resident']:>14,} {r['checkpoint']:>14,} {ratio:>7}")
    return "\n".join(lines)
