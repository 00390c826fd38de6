"""Train a checkpoint's DSpark draft on its own target's greedy continuations (CPU, minutes).

Random ``mtp.*`` weights accept almost nothing, so acceptance could not be measured. This
tool distils the draft stages, ``main_proj``/``main_norm``, the Markov head and the
confidence head from the target:

1. data: random-token prompts, each continued greedily by the target (the full-sequence
   reference, fp32); one traced forward per sequence gives the target features ``f_t``;
2. examples: every anchor ``p`` of a continuation, with the bonus ``x_{p+1}`` and labels
   ``x_{p+2} .. x_{p+k+1}`` (slots past the sequence end are masked);
3. loss: cross-entropy of the Markov-corrected logits of every slot (teacher forcing: slot
   ``i`` is corrected with the true previous token) plus 0.1 x the binary cross-entropy of
   the confidence head against "the greedy draft of this slot is right"; MXFP8 casts pass
   gradients straight through; Adam;
4. the trained values are written back in the released formats (``make_checkpoint``'s
   encoder), replacing only the ``mtp.*`` tensors of ``model.safetensors``.

Everything is seeded and single-threaded, so a seed gives the same bytes. The recipe and
the loss curve of the ``tiny-dspark`` preset are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer_vllm.configs import checkpoint as ckpt
from deepinfer_vllm.ops.dspark import confidence, context_window, markov_logits
from deepinfer_vllm.ops.quant import mxfp8_qdq
from deepinfer_vllm.tools.threads import one_thread, reused_heap

__all__ = ["Recipe", "recipe_prompts", "train_draft"]


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    prompts: int = 8  # training sequences (plus ``held_out`` for evaluation)
    held_out: int = 4
    prompt_len: int = 12
    continuation: int = 24
    steps: int = 100
    batch: int = 32
    lr: float = 2e-3
    confidence_weight: float = 0.1
    log_every: int = 20


def _ste_mxfp8(x: torch.Tensor) -> torch.Tensor:
    return x + (mxfp8_qdq(x.detach()) - x).detach()


@dataclass
class _Examples:
    f: torch.Tensor  # [N, W, F] target features of each anchor's context window
    bonus: torch.Tensor  # [N]
    anchor: torch.Tensor  # [N]
    labels: torch.Tensor  # [N, k]
    valid: torch.Tensor  # [N, k]


def recipe_prompts(recipe: Recipe, vocab_low: int = 3, vocab_high: int = 120_000) -> tuple[list[list[int]], list[list[int]]]:
    """The random-token prompts a recipe trains on and the ones it holds out (seeded)."""
    g = torch.Generator().manual_seed(recipe.seed)
    prompts = [
        torch.randint(vocab_low, vocab_high, (recipe.prompt_len,), generator=g).tolist()
        for _ in range(recipe.prompts + recipe.held_out)
    ]
    return prompts[: recipe.prompts], prompts[recipe.prompts :]


def _sequences(reference, recipe: Recipe, prompts: list[list[int]]) -> list[list[int]]:
    return [p + reference.greedy_generate(p, recipe.continuation) for p in prompts]


def _examples(drafter, seqs: list[list[int]], recipe: Recipe, k: int) -> _Examples:
    a = drafter.arch
    fs, bonus, anchor, labels, valid = [], [], [], [], []
    for seq in seqs:
        with torch.no_grad():
            f = drafter.features(seq).float()
        L = len(seq)
        for p in range(recipe.prompt_len - 1, L - 2):
            pos, ok = context_window(torch.tensor([p]), a.sliding_window)
            fs.append(f[pos[0].clamp_min(0)] * ok[0].unsqueeze(1))
            bonus.append(seq[p + 1])
            anchor.append(p)
            lab = [seq[p + 2 + i] if p + 2 + i < L else 0 for i in range(k)]
            labels.append(lab)
            valid.append([p + 2 + i < L for i in range(k)])
    return _Examples(torch.stack(fs), torch.tensor(bonus), torch.tensor(anchor), torch.tensor(labels), torch.tensor(valid))


def _forward(drafter, w, ex: _Examples, idx: torch.Tensor, k: int):
    """Markov logits ``[B, k, V]`` (teacher-forced) and confidences ``[B, k]``."""
    a = drafter.arch
    B = idx.numel()
    main = drafter.main(ex.f[idx].to(drafter.target.dtype), w)
    hh, base = drafter.block_outputs(main, ex.bonus[idx], ex.anchor[idx], k, w, qdq=_ste_mxfp8)
    hh, base = hh.view(B, k, -1), base.view(B, k, -1)
    last = f"mtp.{a.num_dspark_layers - 1}"
    embed, head = w[f"{last}.markov_head.embed.weight"], w[f"{last}.markov_head.head.weight"]
    proj = w.get(f"{last}.confidence_head.proj.weight")
    prev = torch.cat([ex.bonus[idx].unsqueeze(1), ex.labels[idx][:, :-1]], dim=1)
    logits, confs = [], []
    for i in range(k):
        li, e = markov_logits(base[:, i], prev[:, i], embed, head)
        logits.append(li)
        if proj is not None:
            confs.append(confidence(proj, hh[:, i], e))
    return torch.stack(logits, 1), (torch.stack(confs, 1) if confs else None)


def _accepted_length(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per example, how many leading greedy drafts equal the target's tokens."""
    right = (logits.argmax(-1) == labels) & valid
    return torch.cumprod(right.long(), dim=1).sum(1).double()


def train_draft(model_dir: str | Path, recipe: Recipe = Recipe(), log=print) -> dict:
    """Train ``model_dir``'s draft in place; returns the recipe, the loss curve and the
    held-out greedy acceptance before and after."""
    from safetensors.torch import load_file, save_file

    from deepinfer_vllm.reference.dspark import ReferenceDSpark, load_dspark_weights
    from deepinfer_vllm.reference.model import ReferenceV41

    model_dir = Path(model_dir)
    with one_thread(), reused_heap():
        torch.manual_seed(recipe.seed)
        g = torch.Generator().manual_seed(recipe.seed)
        target = ReferenceV41.from_pretrained(model_dir, dtype=torch.float32)
        a = target.arch
        k = a.dspark_block_size
        dense = load_dspark_weights(a, model_dir)
        w = {n: t.clone().double().requires_grad_(True) for n, t in dense.items()}
        drafter = ReferenceDSpark(target, {})
        t0 = time.perf_counter()
        train_prompts, held_prompts = recipe_prompts(recipe)
        train = _examples(drafter, _sequences(target, recipe, train_prompts), recipe, k)
        held = _examples(drafter, _sequences(target, recipe, held_prompts), recipe, k)
        log(f"train_dspark: {train.bonus.numel()} examples, {held.bonus.numel()} held out ({time.perf_counter() - t0:.0f} s)")

        def held_out_acceptance() -> float:
            with torch.no_grad():
                logits, _ = _forward(drafter, w, held, torch.arange(held.bonus.numel()), k)
            return float(_accepted_length(logits, held.labels, held.valid).mean())

        before = held_out_acceptance()
        opt = torch.optim.Adam(list(w.values()), lr=recipe.lr)
        curve = []
        for step in range(1, recipe.steps + 1):
            idx = torch.randint(0, train.bonus.numel(), (recipe.batch,), generator=g)
            logits, confs = _forward(drafter, w, train, idx, k)
            labels, valid = train.labels[idx], train.valid[idx]
            ce = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
            loss = ce
            if confs is not None:
                right = (logits.detach().argmax(-1) == labels).double()
                bce = torch.nn.functional.binary_cross_entropy(confs[valid].double().clamp(1e-6, 1 - 1e-6), right[valid])
                loss = ce + recipe.confidence_weight * bce
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % recipe.log_every == 0 or step == 1:
                row = {"step": step, "ce": round(float(ce.detach()), 4), "accepted": round(float(_accepted_length(logits.detach(), labels, valid).mean()), 3)}
                curve.append(row)
                log(f"train_dspark: {row}")
        after = held_out_acceptance()
        log(f"train_dspark: held-out greedy accepted length {before:.3f} -> {after:.3f} (k={k}); {time.perf_counter() - t0:.0f} s")

        specs = ckpt.expected_tensors(a)
        path = model_dir / "model.safetensors"
        tensors = load_file(str(path))
        for name, value in w.items():
            m = _stacked_expert(name)
            if m is None:
                tensors.update(ckpt.encode_tensor(name, value.detach().float(), specs))
                continue
            for e in range(value.shape[0]):
                tensors.update(ckpt.encode_tensor(f"{m[0]}.{e}.{m[1]}.weight", value[e].detach().float(), specs))
        save_file(tensors, str(path), metadata={"format": "pt"})
    return {"recipe": asdict(recipe), "curve": curve, "held_out_accepted_before": before, "held_out_accepted_after": after}


def _stacked_expert(name: str) -> tuple[str, str] | None:
    """``mtp.K.ffn.experts.w1`` -> (``mtp.K.ffn.experts``, ``w1``) for stacked expert weights."""
    head, _, proj = name.rpartition(".")
    return (head, proj) if head.endswith(".ffn.experts") and proj in ("w1", "w2", "w3") else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer-train-dspark", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (its mtp.* tensors are replaced)")
    for field, value in asdict(Recipe()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--report", help="write the recipe and loss curve as JSON here")
    args = parser.parse_args(argv)
    recipe = Recipe(**{f: getattr(args, f) for f in asdict(Recipe())})
    report = train_draft(args.model, recipe, log=lambda s: print(s, file=sys.stderr))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
