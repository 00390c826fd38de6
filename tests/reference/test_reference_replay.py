"""The reference's SWA bounded replay (``replay_hits``) and engine-style truncation (``data_len``):
how segments compose, what they leave unchanged, and the admission rules of ``replay_chain``.
The paged model is checked against these semantics in ``tests/model_executor/test_prefix_replay.py``."""

from __future__ import annotations

import pytest
import torch


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model(tiny_reference):
    return tiny_reference


def test_rows_before_a_hit_are_the_earlier_computation_and_later_rows_change(model):
    ids = _ids(70, 1)
    whole = model.forward(ids)
    replayed = model.forward(ids, replay_hits=(33,))
    assert torch.equal(replayed[:33], whole[:33])
    assert not torch.allclose(replayed[33:], whole[33:], atol=1e-3)
    # A segment's rows depend on nothing after them: the prefix up to the next hit alone gives them.
    chained = model.forward(ids, replay_hits=(20, 50))
    assert torch.equal(chained[:50], model.forward(ids[:50], replay_hits=(20,)))
    assert not torch.allclose(chained[50:], replayed[50:], atol=1e-3)


def test_compact_and_mask_agree_on_kept_rows_with_replay(model):
    ids, keep = _ids(80, 2), 20
    mask = model.forward(ids, truncation_mode="mask", keep_tokens=keep, replay_hits=(64,))
    compact = model.forward(ids, truncation_mode="compact", keep_tokens=keep, replay_hits=(64,))
    assert torch.equal(mask[64:], compact[64:])
    assert torch.isnan(compact[:60]).all()


def test_data_len_keeps_rows_after_the_prompt(model):
    """Engine-style truncation: generated rows (past ``data_len``) are kept and their decoder
    windows still reach back to ``data_len - KEEP``; ``data_len = T`` is the old whole-prompt form."""
    ids, keep = _ids(60, 3), 20
    assert torch.equal(
        model.forward(ids, truncation_mode="compact", keep_tokens=keep, data_len=60)[40:],
        model.forward(ids, truncation_mode="compact", keep_tokens=keep)[40:],
    )
    engine = model.forward(ids, truncation_mode="compact", keep_tokens=keep, data_len=45)
    assert not torch.isnan(engine[25:]).any() and torch.isnan(engine[:25]).all()
    # The prompt's rows are those of the prompt alone.
    assert torch.equal(
        engine[25:45], model.forward(ids[:45], truncation_mode="compact", keep_tokens=keep)[25:]
    )


def test_bad_hits_are_refused(model):
    ids = _ids(40, 4)
    with pytest.raises(ValueError, match="longer than the window"):
        model.forward(ids, replay_hits=(8,))  # W = 8: the scheduler recomputes such a hit whole
    with pytest.raises(ValueError, match="shorter than the sequence"):
        model.forward(ids, replay_hits=(40,))
    with pytest.raises(ValueError, match="increase strictly"):
        model.forward(ids, replay_hits=(30, 20))


def test_replay_chain_of_admissions(model):
    chain = model.replay_chain
    admissions = [(0, 30), (48, 60), (33, 70), (5, 80), (64, 90)]
    assert chain(admissions, 30) == ()
    assert chain(admissions, 59) == ()  # the hit at 48 comes with the admission at 60
    assert chain(admissions, 60) == (48,)
    assert chain(admissions, 75) == (33,)  # a shorter hit keeps only the earlier hits below it
    assert chain(admissions, 85) == ()  # a hit within the window is recomputed whole
    assert chain(admissions, 95) == (64,)
    assert chain([(48, 60), (56, 70)], 70) == (48, 56)
    with pytest.raises(ValueError, match="at most 59"):
        chain([(60, 60)], 60)
