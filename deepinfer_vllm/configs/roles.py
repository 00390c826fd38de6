"""Layer roles of DeepSeek-V4.1: what each layer owns and reads.

The roles: docs/architecture.md, "Layer schedule and roles"; DeepInfer's source maps:
docs/design-notes.md, "Layer roles".

``build_roles`` turns the layer schedule of a config (compress ratios, KV and
index sources, the candidate source, Engram layers) into one ``LayerRole`` per
backbone layer and validates the source topology; errors name the
``text_config`` key through the caller's section reader.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerRole", "build_roles", "dspark_roles"]


@dataclass(frozen=True)
class LayerRole:
    """What one layer owns and reads (docs/architecture.md, "Layer schedule and roles").

    ``kv_source``/``index_source`` are the layers whose compressed cache and
    top-k this layer uses (itself when it is a source); ``None`` for SWA-only
    layers. ``uses_candidates`` marks index sources after the candidate source
    in its KV segment (they mask their top-k with its blocks).
    """

    layer_id: int
    ratio: int
    is_kv_source: bool
    is_index_source: bool
    kv_source: int | None
    index_source: int | None
    is_candidate_source: bool
    uses_candidates: bool
    has_engram: bool
    is_decoder: bool
    rope: str  # "main" (ratio 0) or "compress" (ratio >= 1)

    @property
    def kind(self) -> str:
        """Role name: ``swa``, ``full``, ``reindex`` or ``reuse``."""
        if self.ratio == 0:
            return "swa"
        if self.is_kv_source:
            return "full"
        return "reindex" if self.is_index_source else "reuse"


def build_roles(
    t,
    ratios: tuple[int, ...],
    kv_ids: tuple[int, ...],
    index_ids: tuple[int, ...],
    candidate: int,
    engram_ids: tuple[int, ...],
) -> tuple[tuple[LayerRole, ...], int]:
    """Role table of the backbone layers; validates the source topology.

    ``t`` reads the ``text_config`` section (``t.error(key, message)`` makes the
    ``ConfigError`` that names the key). Returns the roles and the first
    decoder layer (the first ratio-1 layer).
    """
    n = len(ratios)
    for key, ids in (("kv_source_layer_ids", kv_ids), ("index_source_layer_ids", index_ids)):
        swa = [i for i in ids if ratios[i] == 0]
        if swa:
            raise t.error(key, f"layers {swa} have compress ratio 0; an SWA-only layer may not be a source")
    missing = sorted(set(kv_ids) - set(index_ids))
    if missing:
        raise t.error("index_source_layer_ids", f"must contain every KV source; missing {missing}")
    first_compressed = next((i for i, r in enumerate(ratios) if r > 0), n)
    late_swa = [i for i in range(first_compressed, n) if ratios[i] == 0]
    if late_swa:
        raise t.error(
            "compress_ratios",
            f"SWA-only layers {late_swa} follow compressed layer {first_compressed}; "
            "they would split a KV-sharing segment",
        )
    first_decoder = next((i for i, r in enumerate(ratios) if r == 1), n)

    roles = []
    kv_src: int | None = None
    idx_src: int | None = None
    for layer, ratio in enumerate(ratios):
        if layer in kv_ids:
            kv_src = layer
        if layer in index_ids:
            idx_src = layer
        if ratio > 0 and (kv_src is None or ratios[kv_src] != ratio):
            raise t.error(
                "kv_source_layer_ids",
                f"layer {layer} (ratio {ratio}) has no KV source of ratio {ratio} at or before it",
            )
        compressed = ratio > 0
        roles.append(
            LayerRole(
                layer_id=layer,
                ratio=ratio,
                is_kv_source=layer in kv_ids,
                is_index_source=layer in index_ids,
                kv_source=kv_src if compressed else None,
                index_source=idx_src if compressed else None,
                is_candidate_source=layer == candidate,
                uses_candidates=(
                    candidate >= 0 and layer in index_ids and layer > candidate and kv_src == candidate
                ),
                has_engram=layer in engram_ids,
                is_decoder=layer >= first_decoder,
                rope="compress" if compressed else "main",
            )
        )
    return tuple(roles), first_decoder


def dspark_roles(n_layers: int, num_dspark: int) -> tuple[LayerRole, ...]:
    """DSpark stages are SWA-only blocks numbered after the backbone ("DSpark stages")."""
    return tuple(
        LayerRole(
            layer_id=n_layers + k,
            ratio=0,
            is_kv_source=False,
            is_index_source=False,
            kv_source=None,
            index_source=None,
            is_candidate_source=False,
            uses_candidates=False,
            has_engram=False,
            is_decoder=False,
            rope="main",
        )
        for k in range(num_dspark)
    )
