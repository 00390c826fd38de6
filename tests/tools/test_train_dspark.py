"""``deepinfer-train-dspark``: seeded (same bytes twice), touches only ``mtp.*``, writes the
released formats, and fits its training continuations (loss falls, acceptance rises)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from deepinfer_vllm.configs.checkpoint import read_safetensors_index, validate_checkpoint_index
from deepinfer_vllm.tools.train_dspark import Recipe, recipe_prompts, train_draft

SMALL = Recipe(prompts=2, held_out=1, prompt_len=6, continuation=6, steps=12, batch=8, lr=3e-3, log_every=4)


@pytest.fixture(scope="module")
def trained_twice(tiny_checkpoint, tmp_path_factory):
    outs = []
    for i in range(2):
        d = tmp_path_factory.mktemp(f"train{i}")
        shutil.copytree(tiny_checkpoint, d, dirs_exist_ok=True)
        outs.append((d, train_draft(d, SMALL, log=lambda line: None)))
    return outs


def test_same_seed_same_bytes_and_only_the_draft_changes(trained_twice, tiny_checkpoint):
    (a, _), (b, _) = trained_twice
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    original = load_file(f"{tiny_checkpoint}/model.safetensors")
    assert ta.keys() == tb.keys() == original.keys()
    changed = set()
    for name in ta:
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
        if not torch.equal(ta[name].view(torch.uint8), original[name].view(torch.uint8)):
            changed.add(name)
    assert changed and all(n.startswith("mtp.") for n in changed)
    import json

    from deepinfer_vllm.configs import V41Arch

    arch = V41Arch.from_config(json.loads((a / "config.json").read_text()))
    validate_checkpoint_index(arch, read_safetensors_index(a))  # still the released formats


def test_training_fits_its_continuations(trained_twice):
    report = trained_twice[0][1]
    curve = report["curve"]
    assert curve[-1]["ce"] < 0.7 * curve[0]["ce"], curve
    assert curve[-1]["accepted"] > curve[0]["accepted"], curve
    assert report["recipe"]["seed"] == 0


def test_recipe_prompts_are_seeded_and_disjoint():
    train, held = recipe_prompts(Recipe())
    assert (len(train), len(held)) == (8, 4)
    assert recipe_prompts(Recipe()) == (train, held)
    assert not {tuple(p) for p in train} & {tuple(p) for p in held}
    assert recipe_prompts(Recipe(seed=1))[0] != train
