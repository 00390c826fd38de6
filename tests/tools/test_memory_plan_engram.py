"""``deepinfer-memory-plan``'s Engram lines follow vLLM's ``engram_config`` (its field names, its
defaults): HBM freed by rows in host memory, host memory per rank and per host, against the Flash
config's arithmetic."""

from __future__ import annotations

import pytest

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.engram_host import host_plan
from deepinfer_vllm.tools.memory_plan import engram_config, main
from deepinfer_vllm.tools.presets import flash_config

ROW = 256 + 256 // 32  # E4M3 values + UE8M0 scales of one row
FLASH_ROWS = (384006168, 384016682)


def test_host_bytes_per_rank_and_per_host():
    arch = V41Arch.from_config(flash_config())
    assert arch.engram_num_embeddings == FLASH_ROWS
    whole = sum(FLASH_ROWS) * ROW  # 202.76 GB
    shard = sum(-(-n // 8) for n in FLASH_ROWS) * ROW  # ceil(rows / 8) per rank
    private = host_plan(arch, tp=1, dp=8, ranks_per_host=8, shared=False)
    assert private == {"per_rank": shard, "mapped_per_rank": shard, "per_host": whole}
    # One copy per host, every rank reading it whole (TP=1), none private.
    assert host_plan(arch, 1, 8, 8, shared=True) == {
        "per_rank": 0,
        "mapped_per_rank": whole,
        "per_host": whole,
    }
    # TP=2 x DP=8 on two hosts of 8: each host holds both TP shards once.
    two = host_plan(arch, 2, 8, 8, shared=True)
    assert two["per_host"] == whole and two["mapped_per_rank"] == sum(-(-n // 2) for n in FLASH_ROWS) * ROW
    # DP=16 over two hosts, private: each host holds half the rows.
    half = host_plan(arch, 1, 16, 8, shared=False)["per_host"]
    assert half == sum(min(8 * -(-n // 16), n) for n in FLASH_ROWS) * ROW


def test_settings_are_vllms():
    assert engram_config(None, dp=8)["dp_shared_memory"] is True  # vLLM's resolution with DP > 1
    assert engram_config(None, dp=1) == {
        "cpu_offload": True,
        "embedding_across_dp": False,
        "dp_shared_memory": False,
        "use_thp": False,
    }
    with pytest.raises(Exception, match="cpu_ofload"):
        engram_config({"cpu_ofload": False}, dp=1)
    with pytest.raises(ValueError, match="dp_shared_memory requires data_parallel_size > 1"):
        engram_config({"dp_shared_memory": True}, dp=1)


@pytest.mark.parametrize(
    "extra, hbm_engram, line",
    [
        ([], 0, "one copy per host shared by its data-parallel ranks"),
        (["--engram-config", '{"dp_shared_memory": false}'], 0, "GB per rank in its own memory"),
        (["--engram-config", '{"cpu_offload": false}'], 1, "Engram rows in HBM"),
    ],
)
def test_cli_reports_the_placement(capsys, extra, hbm_engram, line):
    assert main(["--config", "flash", "--dp", "2", "--ep", "2", "--max-model-len", "4096", *extra]) == 0
    out = capsys.readouterr().out
    shard = sum(-(-n // 2) for n in FLASH_ROWS) * ROW / 1e9
    assert line in out
    rank0 = next(r for r in out.splitlines() if r.strip().startswith("0 "))
    cols = rank0.split()
    experts, engram, dense, emb, hbm, host = (float(c) for c in cols[4:10])
    assert engram == pytest.approx(shard, abs=0.01)
    assert hbm == pytest.approx(experts + dense + emb + hbm_engram * engram, abs=0.02)
    if hbm_engram:
        assert host == 0.0
    else:
        assert f"HBM freed per rank {shard:.2f} GB" in out
        assert f"{sum(FLASH_ROWS) * ROW / 1e9:.2f} GB per host of 2 ranks" in out
