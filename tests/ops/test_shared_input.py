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
        with shared_inputs(x) as inner:  # the innermost scope declaring x makes its own
            form_x = input_form(x, "rev", make)
            assert input_form(c, "rev", make) is form_c  # c: still the outer scope's
            assert inner.made() == {"rev": 1}
        assert input_form(x, "rev", make) is not form_x
        assert outer.made() == {"rev": 2}


def test_an_exception_closes_the_scope():
    x, make = torch.randn(2, 8), Maker()
    with pytest.raises(RuntimeError, match="boom"):
        with shared_inputs(x):
            input_form(x, "rev", make)
            raise RuntimeError("boom")
    input_form(x, "rev", make)
    input_form(x, "rev", make)
    assert make.calls == 3
