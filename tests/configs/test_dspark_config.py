"""DSpark's config-time checks: vLLM's spelling in, our proposer out, clear errors naming the field."""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import EngineArgs

from deepinfer_vllm.configs.dspark import ADDITIONAL_CONFIG_KEY, PROPOSER_CLASS, dspark_settings


def _config(model: str, spec: dict | None, **kwargs):
    return EngineArgs(model=model, max_model_len=256, speculative_config=spec, **kwargs).create_engine_config()


def test_dspark_is_recorded_and_handed_to_our_proposer(tiny_checkpoint):
    cfg = _config(
        tiny_checkpoint, {"method": "dspark", "num_speculative_tokens": 2, "enable_adaptive_verification": True}
    )
    settings = dspark_settings(cfg)
    assert (settings.num_speculative_tokens, settings.adaptive) == (2, True)
    assert cfg.additional_config[ADDITIONAL_CONFIG_KEY] == {"num_speculative_tokens": 2, "adaptive": True}
    spec = cfg.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("custom_class", PROPOSER_CLASS, 2)
    assert spec.enable_adaptive_verification is False  # vLLM's V1 runner refuses it; ours runs it
    assert cfg.num_lookahead_tokens == 0  # draft keys are never stored past the verified tokens


def test_no_speculative_config_means_no_dspark(tiny_checkpoint):
    assert dspark_settings(_config(tiny_checkpoint, None)) is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "dspark", "num_speculative_tokens": 4}, r"num_speculative_tokens=4: .*1 to dspark_block_size \(3\)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, r"speculative_config.method='ngram'"),
        (
            {"method": "dspark", "num_speculative_tokens": 2, "dspark_draft_topk": 4},
            r"dspark_draft_topk",
        ),
    ],
)
def test_bad_speculative_configs_name_the_field(tiny_checkpoint, spec, match):
    with pytest.raises(ValueError, match=match):
        _config(tiny_checkpoint, spec)


def test_checkpoint_without_dspark_stages_is_refused(tmp_path):
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    out = make_checkpoint(tmp_path / "nomtp", preset="tiny", include_dspark=False)
    with pytest.raises(ValueError, match=r"method='dspark': this checkpoint's config has no DSpark stages"):
        _config(str(out), {"method": "dspark", "num_speculative_tokens": 1})


def test_config_with_stages_but_no_stage_tensors_is_refused(tmp_path, tiny_checkpoint):
    """A config that promises DSpark stages over weights exported without them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "stripped"
    shutil.copytree(tiny_checkpoint, out)
    tensors = {n: t for n, t in load_file(str(out / "model.safetensors")).items() if not n.startswith("mtp.")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["text_config"]["num_nextn_predict_layers"] == 2
    with pytest.raises(ValueError, match=r"the checkpoint has no mtp\.\* tensors"):
        _config(str(out), {"method": "dspark", "num_speculative_tokens": 1})


def test_data_parallel_with_dspark_is_handed_to_our_proposer(tiny_checkpoint):
    cfg = _config(
        tiny_checkpoint,
        {"method": "dspark", "num_speculative_tokens": 2},
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert cfg.parallel_config.data_parallel_size == 2
    assert dspark_settings(cfg).num_speculative_tokens == 2
    assert (cfg.speculative_config.method, cfg.speculative_config.model) == ("custom_class", PROPOSER_CLASS)


def test_drafts_env_sets_k_where_vllm_filled_in_the_block_size(tiny_checkpoint, monkeypatch):
    """With the draft ``model`` named and no k, vLLM fills in dspark_block_size (3 for tiny)."""
    spec = {"method": "dspark", "model": tiny_checkpoint}
    assert dspark_settings(_config(tiny_checkpoint, dict(spec))).num_speculative_tokens == 3
    monkeypatch.setenv("DEEPINFER_DSPARK_DRAFTS", "2")
    cfg = _config(tiny_checkpoint, dict(spec))
    assert dspark_settings(cfg).num_speculative_tokens == 2
    assert cfg.speculative_config.num_speculative_tokens == 2
    # An explicit k other than the block size is the user's.
    assert dspark_settings(_config(tiny_checkpoint, {**spec, "num_speculative_tokens": 1})).num_speculative_tokens == 1
    monkeypatch.setenv("DEEPINFER_DSPARK_DRAFTS", "0")
    with pytest.raises(ValueError, match="DEEPINFER_DSPARK_DRAFTS=0"):
        _config(tiny_checkpoint, dict(spec))


def test_old_drafts_env_name_still_works_and_is_named(tiny_checkpoint, monkeypatch, caplog):
    """``DEEPINFER_USE_NEXTN_DECODE`` (the older name) sets k where the new name is unset, the
    log says it is deprecated, and errors name the variable the user set."""
    from deepinfer_vllm import envs

    spec = {"method": "dspark", "model": tiny_checkpoint}
    monkeypatch.delenv("DEEPINFER_DSPARK_DRAFTS", raising=False)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    monkeypatch.setattr(envs, "_warned", set())
    # The plugin's loggers hang under vLLM's, which does not propagate to the root.
    monkeypatch.setattr(envs.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(envs.logger, "propagate", False)
    with caplog.at_level("WARNING", logger="deepinfer_vllm.envs"):
        assert dspark_settings(_config(tiny_checkpoint, dict(spec))).num_speculative_tokens == 2
    assert "DEEPINFER_USE_NEXTN_DECODE is deprecated; set DEEPINFER_DSPARK_DRAFTS instead" in caplog.text
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=0"):
        _config(tiny_checkpoint, dict(spec))
    monkeypatch.setenv("DEEPINFER_DSPARK_DRAFTS", "1")  # the new name wins where both are set
    assert dspark_settings(_config(tiny_checkpoint, dict(spec))).num_speculative_tokens == 1
