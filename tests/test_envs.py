"""``envs``: settings under their current names, and the older names still read (deprecated)."""

from __future__ import annotations

import logging

import pytest

from deepinfer_vllm import envs


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for new, old in envs.DEPRECATED_NAMES.items():
        monkeypatch.delenv(new, raising=False)
        monkeypatch.delenv(old, raising=False)
    monkeypatch.setattr(envs, "_warned", set())


def test_prefill_truncation_settings_under_the_current_names(monkeypatch):
    assert envs.prefill_truncation_settings(16) == ("off", 0)
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", "compact")
    assert envs.prefill_truncation_settings(16) == ("compact", 28)  # window + 12
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS", "20")
    assert envs.prefill_truncation_settings(16) == ("compact", 20)
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS", "8")
    with pytest.raises(ValueError, match="DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS=8 is below"):
        envs.prefill_truncation_settings(16)


def test_prefill_truncation_mode_defaults_to_what_vllms_switch_implies(monkeypatch):
    """Unset, the mode is the model's default (``compact`` with vLLM's ``swa_bounded_replay`` on,
    ``off`` with it off); set, the variable wins either way."""
    assert envs.prefill_truncation_settings(16, "compact") == ("compact", 28)
    assert envs.prefill_truncation_settings(16, "off") == ("off", 0)
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", "off")
    assert envs.prefill_truncation_settings(16, "compact") == ("off", 0)
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", "mask")
    assert envs.prefill_truncation_settings(16, "off") == ("mask", 28)


def test_older_names_are_read_once_deprecated_and_named_in_errors(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "8")
    # The plugin's loggers may hang under vLLM's, which does not propagate to the root.
    monkeypatch.setattr(envs.logger, "handlers", [caplog.handler])
    monkeypatch.setattr(envs.logger, "propagate", False)
    with caplog.at_level(logging.WARNING, logger="deepinfer_vllm.envs"):
        assert envs.prefill_truncation_mode() == "mask"
        assert envs.prefill_truncation_mode() == "mask"
        with pytest.raises(ValueError, match="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=8 is below"):
            envs.prefill_truncation_settings(16)
    deprecations = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert deprecations == [
        (
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE is deprecated; set DEEPINFER_PREFILL_TRUNCATION_MODE "
            "instead (same values)"
        ),
        (
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS is deprecated; set DEEPINFER_PREFILL_TRUNCATION_KEEP_TOKENS "
            "instead (same values)"
        ),
    ]
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "sideways")
    with pytest.raises(ValueError, match="DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='sideways'"):
        envs.prefill_truncation_mode()
    # Where both are set, the current name is the one read.
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", "off")
    assert envs.prefill_truncation_mode() == "off"


def test_dspark_drafts(monkeypatch):
    assert envs.dspark_drafts() is None
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    assert envs.dspark_drafts() == 3
    monkeypatch.setenv("DEEPINFER_DSPARK_DRAFTS", "-1")
    with pytest.raises(ValueError, match="DEEPINFER_DSPARK_DRAFTS=-1; expected a draft count"):
        envs.dspark_drafts()
