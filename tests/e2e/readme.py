"""The README's shell blocks, run word for word the way a user runs them: in a fresh shell
(a login-free ``bash`` with only ``HOME``, ``PATH`` and the locale of this environment)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FRESH_PATH = "/usr/local/bin:/usr/bin:/bin"
README_GROUP = "readme_server"  # xdist_group of the tests that use the shared README server


def section_blocks(heading: str, text: str | None = None) -> list[str]:
    """The ```bash blocks of the README section titled ``heading`` (``## heading``), in order."""
    text = README.read_text() if text is None else text
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README has no section '## {heading}'"
    return re.findall(r"^```bash\n(.*?)^```", match[1], flags=re.M | re.S)


def fresh_shell_env(**extra: str) -> dict[str, str]:
    """What a new terminal has: no virtual environment, no VLLM_* or DEEPINFER_* settings, except
    under ``make test``'s pytest-xdist workers the worker's own OpenMP core (``tests/conftest.py``
    binds each worker's engines to one): an engine left to bind every core spins its OpenMP
    threads against the other worker's engine on that worker's core."""
    env = {
        "HOME": os.environ.get("HOME", "/root"),
        "PATH": FRESH_PATH,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    if os.environ.get("PYTEST_XDIST_WORKER") and "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    env.update(extra)
    return env


def as_script(block: str) -> str:
    """A block as a script that stops at its first failing line (``set -e``), lines as written."""
    return "set -eo pipefail\n" + block
