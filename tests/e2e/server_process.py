"""Start vLLM's OpenAI server on a free port in a child process, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

# Two CPU workers (TP=2 or DP=2) on this 2-core host: one core each.
TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def on_worker_core():
    """A ``preexec_fn`` keeping a child process, and every process it starts, on this pytest-xdist
    worker's core (the one ``tests/conftest.py`` binds the worker's CPU engines' OpenMP threads to),
    for engines that bind none themselves: the simulated NPU's torch threads default to every core
    and, beside the other worker's load, spin at their barriers (a simulated-NPU engine took 219 s
    in CI against 44-49 s alone). None outside a worker or with a binding of several cores."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not bind.isdigit():
        return None
    core = int(bind)
    return lambda: os.sched_setaffinity(0, {core})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(
    model: str, args: list[str], log_path: Path, env: dict | None = None, cli: bool = False,
    bin_dir: Path | None = None, cwd: Path | None = None, pin: bool = False,
) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL ARGS`` (``cli``: the
    ``vllm serve MODEL ARGS`` command) of this environment, or of the one whose scripts are in
    ``bin_dir``; yields its URL once ``/health`` answers (the log goes to ``log_path``),
    terminates it afterwards. ``pin``: the server's processes on this worker's core
    (``on_worker_core``)."""
    port = free_port()
    bin_dir = bin_dir or Path(sys.executable).parent
    if cli:
        cmd = [str(bin_dir / "vllm"), "serve", model, *args, "--port", str(port)]
    else:
        cmd = [str(bin_dir / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args]
        cmd += ["--port", str(port)]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
            preexec_fn=on_worker_core() if pin else None,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
        yield url
    finally:
        stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 600) -> None:
    """Until ``url/health`` answers 200; the server's exit or the timeout raise with its log."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            raise TimeoutError(log_path.read_text()[-4000:])
        time.sleep(2)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server (its process group when it leads one), kill it after 60 s."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
    except ProcessLookupError:
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
