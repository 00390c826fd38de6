"""deepinfer-memory-plan builds the real model class per rank on the meta device; its totals
must equal the checkpoint-size arithmetic written out here from the Flash config alone."""

from __future__ import annotations

import pytest

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.tools.memory_plan import main, plan
from deepinfer_vllm.tools.presets import flash_config


def _fp8(rows: int, cols: int) -> int:
    """E4M3 bytes + one UE8M0 byte per 32x32 tile."""
    return rows * cols + -(-rows // 32) * -(-cols // 32)


def _arithmetic(cfg: dict) -> dict[str, int]:
    """Checkpoint bytes of the backbone by component, from config.json values and the
    released formats (docs/architecture.md, "Checkpoint tensors"): FP8 + 32x32 UE8M0, packed E2M1 +
    UE8M0 per 32, bf16, fp32."""
    t = cfg["text_config"]
    D, H, hd = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    q, o, G = t["q_lora_rank"], t["o_lora_rank"], t["o_groups"]
    E, inter, hc = t["n_routed_experts"], t["moe_intermediate_size"], t["hc_mult"]
    ih, ihd = t["index_n_heads"], t["index_head_dim"]
    mix = hc * (hc + 2)
    dense = D * 2  # final norm
    for layer, ratio in enumerate(t["compress_ratios"][: t["num_hidden_layers"]]):
        dense += 2 * D * 2 + 2 * (mix * hc * D * 4 + mix * 4 + 3 * 4)  # norms, mHC
        dense += _fp8(q, D) + q * 2 + _fp8(H * hd, q) + _fp8(hd, D) + hd * 2  # q and kv paths
        dense += _fp8(G * o, H * hd // G) + _fp8(D, G * o) + H * 4  # output, sinks
        if layer in t["kv_source_layer_ids"]:
            dense += hd * D * 4 * (2 if ratio == 2 else 1) + hd * 2  # compressor (fp32) + norm
            dense += ihd * hd * 2 + ihd * 2  # indexer keys (bf16) + norm
        if layer in t["index_source_layer_ids"]:
            dense += _fp8(ih * ihd, q) + ih * D * 2
        dense += E * D * 2 + 2 * E * 4  # router (bf16) + biases (fp32)
        dense += 2 * _fp8(inter, D) + _fp8(D, inter)  # shared expert
        if layer in t["engram_layer_ids"]:
            cols = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
            dense += _fp8((hc + 1) * D, cols * t["engram_head_dim"]) + 2 * hc * D * 2
    per_expert = 3 * (inter * D // 2 + inter * D // 32)
    dim = t["engram_head_dim"]
    return {
        "experts": t["num_hidden_layers"] * E * per_expert,
        "engram": sum(t["engram_num_embeddings"]) * (dim + dim // 32),
        "dense": dense,
        "embedding_head": 2 * t["vocab_size"] * D * 2,
    }


@pytest.fixture(scope="module")
def flash():
    return _arithmetic(flash_config())


def test_one_rank_holds_exactly_the_checkpoint(flash):
    (rank,) = plan("flash", max_model_len=4096)
    assert rank.weights == flash
    # About 552 B backbone parameters: 501 GB in their formats (3 TB as fp32).
    assert 500e9 < sum(flash.values()) < 503e9
    assert rank.kv_per_token["global"] == 890.0


def test_dp8_ep8_splits_experts_and_engram(flash):
    arch = V41Arch.from_config(flash_config())
    ranks = plan("flash", tp=1, dp=8, ep=8, max_model_len=4096)
    assert len(ranks) == 8
    for r in ranks:
        assert r.weights["experts"] * 8 == flash["experts"]
        assert r.weights["dense"] == flash["dense"] and r.weights["embedding_head"] == flash["embedding_head"]
    # Engram rows: ceil(rows / 8) per rank, the remainder on the last.
    assert sum(r.weights["engram"] for r in ranks) == flash["engram"]
    per_row = arch.engram_head_dim * 33 // 32
    assert ranks[0].weights["engram"] == sum(-(-n // 8) for n in arch.engram_num_embeddings) * per_row


def test_tp8_splits_experts_engram_vocab_and_dense(flash):
    ranks = plan("flash", tp=8, dp=1, ep=1, max_model_len=4096)
    for r in ranks:
        assert r.weights["experts"] * 8 == flash["experts"]  # 2304 / 8 = 288 columns of every expert
        assert r.weights["embedding_head"] * 8 == flash["embedding_head"]
        assert flash["dense"] / 8 < r.weights["dense"] < flash["dense"] / 4
    assert sum(r.weights["engram"] for r in ranks) == flash["engram"]
    assert len({r.weights["dense"] for r in ranks}) == 1


def test_bad_layouts_name_the_setting():
    with pytest.raises(ValueError, match="--ep 4"):
        plan("flash", tp=1, dp=8, ep=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        plan("flash", tp=3)


def test_cli_prints_the_table(capsys):
    assert (
        main(["--config", "flash", "--dp", "2", "--ep", "2", "--engram-host", "--max-model-len", "4096"]) == 0
    )
    out = capsys.readouterr().out
    assert "global 890.0" in out and "host" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2


@pytest.mark.parametrize("redundant", [0, 8, 32])
def test_dp8_ep8_with_redundant_experts(flash, redundant):
    """Expert load balancing's redundant experts cost (384 + R) / 8 slots per layer on every rank:
    one expert's bytes times the slots, nothing else changes."""
    arch = V41Arch.from_config(flash_config())
    ranks = plan("flash", tp=1, dp=8, ep=8, max_model_len=4096, redundant_experts=redundant)
    slots = (arch.n_routed_experts + redundant) // 8
    for r in ranks:
        assert r.expert_slots == slots
        assert r.weights["experts"] * arch.n_routed_experts == flash["experts"] * slots
        assert r.weights["dense"] == flash["dense"]


def test_redundant_experts_must_split_over_the_ranks():
    with pytest.raises(ValueError, match="do not split equally"):
        plan("flash", tp=1, dp=8, ep=8, redundant_experts=4)
    with pytest.raises(ValueError, match="--redundant-experts needs expert parallelism"):
        plan("flash", tp=8, redundant_experts=8)


def test_cached_prefix_tokens_with_window_kv_out_of_the_prefix_cache():
    """Per cached prefix token, window KV out of the cache keeps the global records and the Engram
    ids (890 + 4 B); cached with the prefix, the window pages of all 40 layers besides
    (40 x 528 B, docs/architecture.md, "Bytes per token"): 24.6x fewer tokens fit."""
    from deepinfer_vllm.tools.memory_plan import GIB, cached_prefix_tokens

    (rank,) = plan("flash", tp=8, dp=1, ep=1, max_model_len=4096)[:1]
    args = {"hbm_gib": 141e9 / GIB, "utilization": 0.9, "reserve_gib": 8.0, "requests": 256, "engram_host": False}
    n = cached_prefix_tokens(rank, prefix_len=8192, **args)
    budget = 141e9 * 0.9 - sum(rank.weights.values()) - 8 * GIB - 256 * rank.window_per_request
    assert n["replay"] == int(budget // (890 + 4))
    assert n["cached"] == int(budget // (890 + 4 + 40 * 528))
    assert 24.5 < n["replay"] / n["cached"] < 24.7
    # Hit only at the ends of 8192-token prefixes, each keeps one running request's window pages.
    assert n["cached"] < n["cached_ends"] < n["replay"]
