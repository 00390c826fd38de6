"""The README's demo: examples/offline_inference.py generates text through vLLM on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offline_inference.py"


def test_offline_inference_example_prints_generated_text(tiny_checkpoint):
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", tiny_checkpoint, "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    generated = re.findall(r"^generated: '(.*)'$", run.stdout, flags=re.M)
    assert len(generated) == 3 and all(text.strip() for text in generated), run.stdout
    token_lists = re.findall(r"^token ids: \[(.*)\]$", run.stdout, flags=re.M)
    assert [len(t.split(",")) for t in token_lists] == [8, 8, 8]
    assert re.search(r"^24 tokens in [0-9.]+ s: [0-9.]+ tokens/s$", run.stdout, flags=re.M)
