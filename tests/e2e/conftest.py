"""The servers several e2e modules share (one engine start each, per pytest process).

Under pytest-xdist the tests of one server carry its ``xdist_group`` mark, and ``make test``
runs with ``--dist loadgroup``, so each shared server starts in one worker only.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests
from readme import ROOT, as_script, fresh_shell_env, section_blocks
from server_process import stop, wait_healthy

README_URL = "http://127.0.0.1:8000"  # the port the README's client block names (vLLM's default)


@pytest.fixture(scope="session")
def readme_server(tmp_path_factory):
    """The README's Serving block 1, word for word, in a fresh shell at the repository root
    (after the two commands: ``.venv`` and ``build/tiny`` exist); yields (url, log path).
    No ``VLLM_CPU_KVCACHE_SPACE``: the platform sizes the KV cache itself."""
    if not (ROOT / "build" / "tiny" / "config.json").exists():  # `make test` builds it first
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deepinfer_vllm.tools.make_checkpoint",
                "--preset",
                "tiny",
                "--out",
                str(ROOT / "build" / "tiny"),
            ],
            check=True,
            capture_output=True,
        )
    try:  # vLLM binds with SO_REUSEPORT: a second server on the port would share its requests
        requests.get(f"{README_URL}/health", timeout=2)
        raise RuntimeError(f"something already serves {README_URL}: the README's server needs that port")
    except requests.ConnectionError:
        pass
    serve = section_blocks("Serving")[0]
    log_path = tmp_path_factory.mktemp("readme_server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", as_script(serve)],
            cwd=ROOT,
            env=fresh_shell_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(proc, README_URL, log_path)
        yield README_URL, log_path
    finally:
        stop(proc)
