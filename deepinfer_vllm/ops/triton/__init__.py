"""Triton kernels for V4.1's attention hot path (CUDA; SM90 and SM100).

Each module holds a kernel and its Python wrapper; the PyTorch reference it
must match lives beside it in ``deepinfer_vllm.ops`` and runs everywhere.
Importing this package needs Triton but no GPU and no vLLM.
"""
