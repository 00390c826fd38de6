"""Build the bundle that lets ``tests/gpu_model`` import vLLM on the GPU host (run here).

    python tests/gpu_model/carry.py            # writes build/gpu_carry/ (about 25 MB)

then on the device, with ``build/gpu_carry`` carried: ``bash tests/gpu_model/run.sh``.

* ``vllm_src.tar.xz``: vLLM's Python sources (``.py``, ``.json``, ``.jinja``) from this
  environment's ``vllm`` module, without its compiled extensions;
* ``wheels/``: CPython 3.12 manylinux wheels, at this environment's versions, of the
  modules importing vLLM and the plugin needs that the GPU host lacks (``MISSING``,
  probed on the H200 host on 2026-12-02; it already has torch, Triton, numpy,
  transformers, tokenizers, safetensors, huggingface_hub, aiohttp, PIL and the rest).
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "gpu_carry"
MISSING = (
    "annotated-types cachetools cbor2 compressed-tensors fastapi httpcore2 httpx2 llguidance loguru "
    "msgspec openai oss-harmony partial-json-parser pybase64 pydantic pydantic_core pydantic-extra-types "
    "sniffio starlette truststore apache-tvm-ffi typing-inspection xgrammar pyzmq"
).split()
PLATFORMS = [
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_5_x86_64",
    "any",
]


def main() -> None:
    import vllm

    OUT.mkdir(parents=True, exist_ok=True)
    src = Path(vllm.__file__).parent
    with tarfile.open(OUT / "vllm_src.tar.xz", "w:xz") as tar:
        for path in sorted(src.rglob("*")):
            if path.suffix in (".py", ".json", ".jinja") and "__pycache__" not in path.parts:
                tar.add(path, arcname=str(Path("vllm") / path.relative_to(src)))
    wheels = OUT / "wheels"
    wheels.mkdir(exist_ok=True)
    pins = [f"{name}=={md.version(name)}" for name in MISSING]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--abi",
        "abi3",
        "--abi",
        "none",
        "-d",
        str(wheels),
        *[a for p in PLATFORMS for a in ("--platform", p)],
        *pins,
    ]
    subprocess.run(cmd, check=True)
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({size / 2**20:.1f} MiB): vLLM {vllm.__version__} sources, {len(pins)} wheels")


if __name__ == "__main__":
    main()
