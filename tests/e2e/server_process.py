"""Start vLLM's OpenAI server on a free port in a child process, for the server tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

# Two CPU workers (TP=2 or DP=2) on this 2-core host: one core each.
TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(
    model: str, args: list[str], log_path: Path, env: dict | None = None, cli: bool = False
) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL ARGS`` (``cli``: the
    ``vllm serve MODEL ARGS`` command of this environment); yields its URL once ``/health``
    answers (the log goes to ``log_path``), terminates it afterwards."""
    port = free_port()
    if cli:
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, *args, "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args]
        cmd += ["--port", str(port)]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise TimeoutError(log_path.read_text()[-4000:])
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
