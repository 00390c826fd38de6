"""The backend's metadata builder: the per-token request rows and per-request lengths it
derives from vLLM's common metadata, in buffers whose addresses never change between
steps (what a replayed CUDA graph reads), and the static bound of a captured step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

from deepinfer_vllm.attention_backends.mla_swa import V41MetadataBuilder

MAX_MODEL_LEN = 256


def _builder() -> V41MetadataBuilder:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=32),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
    )
    return V41MetadataBuilder(SimpleNamespace(block_size=16), ["layer"], config, torch.device("cpu"))


def _common(query_lens: list[int], context_lens: list[int], width: int = 16) -> CommonAttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([q + c for q, c in zip(query_lens, context_lens)], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    table = torch.arange(4 * width, dtype=torch.int32).view(4, width)  # the runner's full table
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=int(seq.max()),
        block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        positions=positions,
    )


def test_rows_and_lengths_from_the_common_metadata():
    meta = _builder().build(0, _common([3, 1, 0, 2], [5, 9, 4, 0]))
    assert meta.token_req.tolist() == [0, 0, 0, 1, 3, 3]  # an empty request owns no token
    assert meta.context_lens.tolist() == [5, 9, 4, 0]
    assert meta.seq_lens.tolist() == [8, 10, 4, 2]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 4, 6]
    assert meta.positions.tolist() == [5, 6, 7, 9, 0, 1]
    assert meta.block_table.dtype == torch.int64 and meta.block_table.shape == (4, 16)
    assert torch.equal(meta.block_table, torch.arange(64).view(4, 16))
    assert (meta.max_seq_len, meta.max_query_len) == (10, 3)


def test_buffers_keep_their_addresses_across_steps():
    builder = _builder()
    first = builder.build(0, _common([1, 1], [7, 3]))
    second = builder.build(0, _common([1, 1], [8, 4]))
    for name in ("query_start_loc", "seq_lens", "context_lens", "token_req", "block_table"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert second.context_lens.tolist() == [8, 4] and second.seq_lens.tolist() == [9, 5]


def test_captured_steps_use_the_static_bound_and_uniform_decode_is_declared():
    builder = _builder()
    assert builder._cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    meta = builder.build_for_cudagraph_capture(_common([1, 1, 1], [2, 40, 6]))
    assert meta.max_seq_len == MAX_MODEL_LEN
    assert builder.build(0, _common([1], [2])).max_seq_len == 3


def test_a_step_larger_than_the_buffers_is_refused_by_name():
    with pytest.raises(ValueError, match="max_num_seqs / max_num_batched_tokens"):
        _builder().build(0, _common([30, 3], [0, 0]))


def test_padded_tokens_go_to_the_padding_request():
    """vLLM pads a uniform decode batch for a CUDA graph with requests of no tokens, null
    block rows and seq_len 0; the padding tokens then belong to the last (padding) row."""
    common = _common([1, 1, 0, 0], [4, 6, 0, 0])
    common.num_actual_tokens = 4  # 2 scheduled tokens padded to 4
    common.positions = torch.tensor([4, 6, 0, 0])
    common.seq_lens_cpu_upper_bound = common.seq_lens.clone()
    meta = _builder().build(0, common)
    assert meta.token_req.tolist() == [0, 1, 3, 3]
    assert meta.seq_lens.tolist() == [5, 7, 0, 0]


def test_padding_without_a_padding_request_is_refused():
    common = _common([1, 2], [4, 6])
    common.num_actual_tokens = 5  # 3 scheduled tokens padded to 5, the last row a real request
    common.positions = torch.arange(5)
    common.seq_lens_cpu_upper_bound = common.seq_lens.clone()
    with pytest.raises(NotImplementedError, match="uniform decode batches only"):
        _builder().build(0, common)
