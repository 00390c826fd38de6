"""Activations that several GEMMs multiply: a kernel's preparation of them, made once.

Some of a layer's GEMMs share their input: V4.1's ``wq_a`` and ``wkv`` both multiply the
attention's input, the query projection ``wq_b`` and the indexer's ``wq_b`` both multiply the
normed query latent, the shared expert's ``w1`` and ``w3`` both multiply the MoE's input. A GEMM
kernel that first turns its input into another form (the Gluon FP8 GEMMs rewrite ``x`` in
their staging order, ``moe_gemm_gluon.x_tile_order``: one launch and one pass over ``x``) makes
that form once for all of them when the model declares the sharing::

    with shared_inputs(x):
        c_q, kv = q_norm(wq_a(x)), kv_norm(wkv(x))
    with shared_inputs(c_q):
        q, idx_q = wq_b(c_q), idx_wq_b(c_q)

and the kernel asks ``input_form(x, "tile_order", x_tile_order)`` instead of calling
``x_tile_order(x)`` (likewise the MXFP8 round trip of ``DEEPINFER_GEMM_ACTIVATIONS=mxfp8``, whose
result is then shared in turn). Outside a scope, or for a tensor not declared, ``input_form``
simply makes the form. The forms are pure functions of the values, so sharing changes no bit of
any output; it saves launches and passes.

A tensor is recognised by what its data is (device, dtype, address, shape and strides): the
2-D view a GEMM wrapper takes of a declared ``[T, K]`` tensor is the same tensor. A form is
recognised by its name and the function that makes it. The scope holds the declared tensors
(their memory cannot be reused while it is open) and the forms it made, and drops both when it
closes, so a form lives until its scope ends rather than until its GEMM does: declare around the
GEMMs that share, not around a whole layer. Declared tensors must not be written while the scope
is open. A form is made by the code that runs inside the scope, and one made outside a CUDA graph
capture is never reused inside it (nor the other way round), so a captured graph always holds the
launches that make what it reads. Imports no vLLM.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["SharedInputs", "input_form", "shared_inputs"]

_Key = tuple


def _key(x: torch.Tensor) -> _Key:
    return (x.device, x.dtype, x.data_ptr(), tuple(x.shape), tuple(x.stride()))


# A form: what ``make`` returned, and whether a CUDA graph was being captured when it was made.
_Form = tuple[torch.Tensor, bool]
_FormKey = tuple[str, Callable]


class SharedInputs:
    """The tensors one scope declares shared, each with the forms made of it so far."""

    def __init__(self) -> None:
        self._entries: dict[_Key, tuple[torch.Tensor, dict[_FormKey, _Form]]] = {}

    def add(self, *xs: torch.Tensor) -> None:
        """Declare more shared tensors (e.g. one computed inside the scope)."""
        for x in xs:
            self._entries.setdefault(_key(x), (x, {}))

    def forms(self, x: torch.Tensor) -> dict[_FormKey, _Form] | None:
        entry = self._entries.get(_key(x))
        return None if entry is None else entry[1]

    def made(self) -> dict[str, int]:
        """How many forms of each name this scope made (tests, diagnostics)."""
        counts: dict[str, int] = {}
        for _, forms in self._entries.values():
            for name, _ in forms:
                counts[name] = counts.get(name, 0) + 1
        return counts


_local = threading.local()


def _open_scopes() -> list[SharedInputs]:
    scopes = getattr(_local, "scopes", None)
    if scopes is None:
        scopes = _local.scopes = []
    return scopes


@contextlib.contextmanager
def shared_inputs(*xs: torch.Tensor) -> Iterator[SharedInputs]:
    """Declare ``xs`` (and later ``.add(...)``) shared by the GEMMs run inside the block."""
    scope = SharedInputs()
    scope.add(*xs)
    scopes = _open_scopes()
    scopes.append(scope)
    try:
        yield scope
    finally:
        scopes.remove(scope)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def input_form(x: torch.Tensor, name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(x)``, made once while a scope that declared ``x`` is open: a form already made (by the same
    ``make``) in any open scope declaring ``x`` is reused (innermost first), else it is made in the
    innermost one. A form of a declared tensor is declared in the same scope (the GEMMs sharing ``x``
    share what is made of it too: the MXFP8 round trip of ``x``, then that round trip's rewrite). A form
    made outside a CUDA graph capture is not reused inside one, nor the other way round: the graph must
    hold the launch that makes what it reads."""
    scopes = _open_scopes()
    if not scopes:
        return make(x)
    key = (name, make)
    capturing = _capturing(x)
    declaring = None
    for scope in reversed(scopes):
        forms = scope.forms(x)
        if forms is None:
            continue
        form = forms.get(key)
        if form is not None and form[1] == capturing:
            return form[0]
        if declaring is None:
            declaring = scope, forms
    if declaring is None:
        return make(x)
    scope, forms = declaring
    made = make(x)
    forms[key] = made, capturing
    scope.add(made)
    return made
