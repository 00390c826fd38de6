"""``ops.shared_input``: a GEMM input's prepared form made once for the GEMMs sharing it."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops.shared_input import input_form, shared_inputs


class Maker:
    """A form (the rows reversed) that counts how often it was made."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.flip(0).clone()


def test_made_once_for_a_declared_tensor_and_its_2d_view():
    x, make = torch.randn(6, 8), Maker()
    with shared_inputs(x) as shared:
        first = input_form(x, "rev", make)
        again = input_form(x.reshape(-1, 8), "rev", make)  # the view a GEMM wrapper takes
        assert again is first
        assert make.calls == 1
        assert shared.made() == {"rev": 1}
    assert torch.equal(first, x.flip(0))
    # closed: made anew (the scope dropped its forms)
    assert input_form(x, "rev", make) is not first
    assert make.calls == 2


def test_undeclared_tensors_and_other_views_are_made_each_time():
    x, y, make = torch.randn(6, 8), torch.randn(6, 8), Maker()
    with shared_inputs(x):
        for t in (y, y, x[:3], x[:, :4], x.t()):
            assert torch.equal(input_form(t, "rev", make), t.flip(0))
        assert make.calls == 5
        # names are separate forms of the same tensor
        input_form(x, "rev", make)
        input_form(x, "other", make)
        assert make.calls == 7


def test_added_inside_the_scope_and_nested_scopes():
    x, make = torch.randn(4, 8), Maker()
    with shared_inputs(x) as outer:
        c = x * 2  # computed inside the scope, declared after
        assert input_form(c, "rev", make) is not input_form(c, "rev", make)
        outer.add(c)
        form_c = input_form(c, "rev", make)
        with shared_inputs(x) as inner:  # x has no form yet: made in the innermost scope declaring it
            form_x = input_form(x, "rev", make)
            assert input_form(c, "rev", make) is form_c  # c: the outer scope's
            assert inner.made() == {"rev": 1}
        assert input_form(x, "rev", make) is not form_x  # the inner scope closed with its form
        with shared_inputs(x) as inner:  # a form an outer scope made is reused
            assert input_form(x, "rev", make) is input_form(x, "rev", make)
            assert inner.made() == {}
        assert outer.made() == {"rev": 2}


def test_forms_of_a_declared_tensor_are_shared_too():
    x, first, second = torch.randn(4, 8), Maker(), Maker()
    with shared_inputs(x):
        for _ in range(3):  # e.g. the MXFP8 round trip of x, then its rewrite
            y = input_form(input_form(x, "a", first), "b", second)
        assert (first.calls, second.calls) == (1, 1)
        assert torch.equal(y, x)  # reversed twice


def test_gemm_activations_round_trip_once_per_shared_input(monkeypatch):
    """``DEEPINFER_GEMM_ACTIVATIONS=mxfp8``: the GEMMs sharing ``x`` share its MXFP8 round trip."""
    pytest.importorskip("triton")
    from deepinfer_vllm.ops import quant
    from deepinfer_vllm.ops.triton import fp8_gemm

    calls = []
    monkeypatch.setattr(fp8_gemm, "mxfp8_qdq", lambda t: calls.append(1) or quant.mxfp8_qdq(t))
    x = torch.randn(3, 64).to(torch.bfloat16)
    want = quant.mxfp8_qdq(x)
    with shared_inputs(x):
        got = [fp8_gemm.gemm_activations(x, "mxfp8") for _ in range(3)]
    assert len(calls) == 1 and all(g is got[0] for g in got)
    assert torch.equal(got[0].view(torch.int16), want.view(torch.int16))
    fp8_gemm.gemm_activations(x, "mxfp8")
    assert len(calls) == 2
    assert fp8_gemm.gemm_activations(x, "bf16") is x  # nothing to make


def test_an_exception_closes_the_scope():
    x, make = torch.randn(2, 8), Maker()
    with pytest.raises(RuntimeError, match="boom"):
        with shared_inputs(x):
            input_form(x, "rev", make)
            raise RuntimeError("boom")
    input_form(x, "rev", make)
    input_form(x, "rev", make)
    assert make.calls == 3


def test_forms_are_told_apart_by_maker_and_by_graph_capture(monkeypatch):
    from deepinfer_vllm.ops import shared_input

    x, a, b = torch.randn(4, 8), Maker(), Maker()
    with shared_inputs(x):
        assert input_form(x, "rev", a) is not input_form(x, "rev", b)  # same name, another maker
        eager = input_form(x, "rev", a)
        assert (a.calls, b.calls) == (1, 1)
        # a form made outside a CUDA graph capture is not reused inside one (the graph would not hold its
        # launch), and one made inside is not reused outside
        monkeypatch.setattr(shared_input, "_capturing", lambda t: True)
        captured = input_form(x, "rev", a)
        assert captured is not eager and input_form(x, "rev", a) is captured
        monkeypatch.setattr(shared_input, "_capturing", lambda t: False)
        assert input_form(x, "rev", a) is not captured
        assert a.calls == 3
