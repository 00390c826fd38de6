"""Thread settings of the tools' CPU work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
