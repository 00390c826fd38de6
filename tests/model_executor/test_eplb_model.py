"""Expert load balancing in the model: its settings, and (``eplb_ranks.py``, two gloo processes) the
routed experts with balancing against without it and against one rank holding every expert, through
rebalances that move expert weights between the processes; vLLM's own ``EplbState`` driving the
same layers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer_vllm.model_executor.eplb import EplbSettings, check_eplb, eplb_settings

HERE = Path(__file__).parent


def _config(additional=None, enable_eplb=False, eplb_config=None, tp=1, dp=2, ep=True):
    par = SimpleNamespace(
        enable_eplb=enable_eplb,
        eplb_config=eplb_config,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_expert_parallel=ep,
    )
    return SimpleNamespace(parallel_config=par, additional_config=additional or {})


def test_plugin_settings_read_vllms_field_names():
    cfg = _config(
        {
            "enable_eplb": True,
            "eplb_config": {"window_size": 4, "step_interval": 8, "num_redundant_experts": 2},
        }
    )
    assert eplb_settings(cfg) == EplbSettings(4, 8, 2, False, "deepinfer")
    # vLLM's defaults where a field is left out.
    assert eplb_settings(_config({"enable_eplb": True})) == EplbSettings(1000, 3000, 0, False, "deepinfer")
    assert eplb_settings(_config({})) is None
    vllm_side = SimpleNamespace(
        window_size=5, step_interval=6, num_redundant_experts=8, log_balancedness=True
    )
    assert eplb_settings(_config(enable_eplb=True, eplb_config=vllm_side)) == EplbSettings(
        5, 6, 8, True, "vllm"
    )


@pytest.mark.parametrize(
    "additional,match",
    [
        ({"eplb_config": {"window_size": 4}}, "enable_eplb"),
        ({"enable_eplb": "yes"}, "enable_eplb"),
        ({"enable_eplb": True, "eplb_config": {"window": 4}}, r"\['window'\]"),
        ({"enable_eplb": True, "eplb_config": {"step_interval": 0}}, "step_interval"),
        ({"enable_eplb": True, "eplb_config": {"num_redundant_experts": -1}}, "num_redundant_experts"),
        ({"enable_eplb": True, "eplb_config": {"policy": "swift"}}, "policy"),
    ],
)
def test_bad_settings_name_the_field(additional, match):
    with pytest.raises((ValueError, TypeError), match=match):
        eplb_settings(_config(additional))


def test_parallel_sizes_are_checked():
    settings = EplbSettings(4, 8, 2, False, "deepinfer")
    check_eplb(settings, 8, _config().parallel_config)  # 10 slots over 2 ranks
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        check_eplb(settings, 8, _config(ep=False).parallel_config)
    with pytest.raises(ValueError, match="do not split equally"):
        check_eplb(settings._replace(num_redundant_experts=1), 8, _config().parallel_config)


def test_vllm_refuses_enable_eplb_on_cpu():
    """Why the plugin reads the same fields from ``additional_config`` on its platforms."""
    from vllm.config import ParallelConfig, VllmConfig

    par = ParallelConfig(enable_expert_parallel=True)
    par.enable_eplb = True
    with pytest.raises(ValueError, match="only supported on CUDA"):
        VllmConfig(parallel_config=par)


@pytest.fixture(scope="module")
def ranks_report(tmp_path_factory):
    from vllm.utils.network_utils import get_open_port

    out = tmp_path_factory.mktemp("eplb") / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "eplb_ranks.py"), str(get_open_port()), str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["fp32", "bf16-bi"])
def test_balanced_experts_equal_unbalanced_through_rebalances(ranks_report, mode):
    """fp32, and bf16 with DEEPINFER_BATCH_INVARIANT=1: every step's output with balancing equals
    the output without it and one rank's, bit for bit, before and after four rebalances that all
    moved experts (maps differ), with every slot holding its expert's bytes after each move."""
    r = ranks_report[mode]
    steps = len(r["equal_base"])
    assert r["equal_base"] == [True] * steps
    assert r["equal_one"] == [True] * steps
    assert r["rebalances"] == 4 and r["moved_rebalances"] == 4
    maps = [json.dumps(m) for m in r["maps"]]
    assert len(set(maps)) == len(maps) >= 2
    assert r["slots_ok"] == [True] * 4 and r["slots_ok_all_ranks"]
    if mode == "bf16-bi":  # a token alone equals itself in the batch, with replicas in play
        assert r["alone_equal"] == [True] * steps
    # Skewed traffic: max/mean received pairs per rank falls once balanced (steps 0-2 run on the
    # initial placement; the hot experts move at step 6, so steps 6-8 run on a stale placement).
    before = sum(r["imbalance"][:3]) / 3
    after = sum(r["imbalance"][3:6] + r["imbalance"][9:]) / 6
    assert before > 1.3 and after < before - 0.15, r["imbalance"]


def test_vllm_eplb_state_drives_the_layers(ranks_report):
    r = ranks_report["vllm_state"]
    assert r["is_mixture_of_experts"] and r["views"] and r["counted"]
    assert r["map_changed"] and r["slots_ok"] and r["equal_one"]
    # What does not run on a CPU: EplbState.rearrange's own timing events.
    assert "doesn't support events" in r["rearrange_error"]
