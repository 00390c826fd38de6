"""The README's Serving section as a user runs it after the two commands: block 1 (``vllm
serve``) in one fresh shell (the shared ``readme_server``), block 2 (the ``openai`` example)
in another, word for word; then the request-options matrix against that server (one CPU rank,
bf16, the README's flags)."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest
from readme import README_GROUP, ROOT, as_script, fresh_shell_env, section_blocks
from request_options import Server, run_matrix

pytestmark = pytest.mark.xdist_group(README_GROUP)

WEATHER = {  # the example's get_weather tool
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}


def test_serving_blocks_run_verbatim(readme_server):
    url, log_path = readme_server
    blocks = section_blocks("Serving")
    assert len(blocks) == 2 and "vllm serve build/tiny" in blocks[0] and "openai_client.py" in blocks[1]
    run = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", as_script(blocks[1])],
        cwd=ROOT,
        env=fresh_shell_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert re.search(r"^chat: '.+'$", out, flags=re.M), out
    assert re.search(r"^reasoning: '.+'$", out, flags=re.M), out  # thinking answer: reasoning apart
    call = re.search(r"^tool call \(tool_calls\): get_weather (\{.*\})$", out, flags=re.M)
    assert call, out
    jsonschema.validate(json.loads(call[1]), WEATHER)
    person = re.search(r"^json \(stop\): (\{.*\})$", out, flags=re.M)
    assert person, out
    assert set(json.loads(person[1])) == {"name", "age"}
    log = log_path.read_text()
    # No VLLM_CPU_KVCACHE_SPACE in a fresh shell: the platform chose the KV cache and said so.
    assert "VLLM_CPU_KVCACHE_SPACE is unset, so each of 1 worker(s) gets a" in log
    assert "DeepInfer V4.1 on CPU: block_size=64, chunked_prefill=True, prefix_caching=True" in log
    # vLLM's stock MLA line appears on hosts without AMX tiles only; the note on it follows it.
    stock = "forcing chunked prefill and prefix caching to be disabled" in log
    assert stock == ("supports both, so they are restored as listed above" in log)
    assert "expand_kernel is already registered. Overwriting." in log  # vLLM's warning on our fix...
    assert "is this platform's fix of vLLM's rejection-sampler fallback" in log  # ...explained


def test_request_options_one_cpu_rank(readme_server):
    outcomes = run_matrix(Server(readme_server[0]))
    print(json.dumps(outcomes, indent=1))
    assert all(v == "answered" for v in outcomes.values()), outcomes
