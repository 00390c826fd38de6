"""Thread and allocator settings of the tools' CPU work."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

import torch

# glibc's mallopt parameters and their defaults (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded: the tensors are small, and on a busy host the
    intra-op thread barriers cost far more than they save."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _glibc():
    """The C library when it is glibc (its ``mallopt`` parameters are glibc's), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    glibc = all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim"))
    return libc if glibc else None


@contextlib.contextmanager
def reused_heap() -> Iterator[None]:
    """Keep freed memory in the process's heap while the block runs (glibc; elsewhere nothing changes).

    glibc serves each allocation above its mmap threshold (at most 32 MB) with a fresh mapping and unmaps
    it on free, so a loop that allocates the same large tensors every step faults every page in again:
    the draft training's fp64 logits over the vocabulary (about 165 MB a step for ``tiny``) spent a third
    of its time in the kernel that way (97 s with 33 s of system time; 64 s with this, same bytes). On exit
    the heap is trimmed and glibc's default values are set back (``mallopt`` cannot read the values before;
    once either is set, glibc no longer adapts its mmap threshold for the rest of the process)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)  # an int: about 2 GiB
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
