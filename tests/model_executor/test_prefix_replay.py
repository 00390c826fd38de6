"""SWA bounded replay over paged caches equals the reference's replay semantics, bit for bit (fp32).

Under vLLM's ``swa_bounded_replay`` (on by default) window KV stays out of the prefix cache. A
prefix hit of ``h`` tokens then shares only the prefix-cacheable caches (compressed KV, index
keys, Engram token history), and the request recomputes the hit's last window ``h - W .. h-1``
into fresh window caches, its windows clipped at ``h - W`` in every layer, without rewriting the
cached compressed entries (``PagedHarness.prefix_hit`` admits a request the way vLLM's
scheduler does). The reference computes the same function of the tokens and the hits
(``ReferenceV41.forward(replay_hits=...)``). These run with the default prefill truncation that
the same switch turns on (``compact``, ``KEEP = W + 12``).
"""

from __future__ import annotations

import pytest
import torch
from v41_harness import PagedHarness

from deepinfer_vllm.ops.dspark import context_window, target_features
from deepinfer_vllm.reference.model import ForwardTrace

W = 8  # the tiny model's window
KEEP = W + 12
# Hits relative to the window (W + 1 is the shortest replayed hit), to the ratio-2 pairs (odd and
# even hits and replay starts), to the harness's 16-token blocks (on and inside a block), and to
# the truncation's kept range of the 115-token requests (from 95 on).
HITS = (9, 10, 15, 16, 17, 33, 40, 63, 64, 65, 71, 81)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120000, (n,), generator=g).tolist()


def _run(harness, rid, tokens, sizes, prompt_len):
    outs, i = [], 0
    for n in sizes:
        if i >= len(tokens):
            break
        outs.append(harness.step([(rid, tokens[i : i + n])], prompt_lens=[prompt_len]))
        i += n
    assert i >= len(tokens)
    return torch.cat(outs)


@pytest.fixture(scope="module")
def harness(tiny_checkpoint, single_thread):
    return PagedHarness(tiny_checkpoint, dtype="float32", swa_bounded_replay=True)


def _global_pages(harness, rid):
    """Bytes of the prefix-cacheable caches' blocks of request ``rid``."""
    out = {}
    for name, layer in harness.model.cache_layers.items():
        if layer.get_kv_cache_spec(harness.cfg).prefix_cacheable:
            out[name] = layer.kv_cache[harness.requests[rid].blocks[name]].clone()
    return out


def test_replay_is_on_with_compact_truncation_by_default(harness):
    specs = {
        layer.kind: layer.get_kv_cache_spec(harness.cfg) for layer in harness.model.cache_layers.values()
    }
    assert not specs["window"].prefix_cacheable and specs["window"].prefix_replay_tokens == W
    assert specs["compressed"].prefix_cacheable and specs["index"].prefix_cacheable
    # The token history keeps every id (the replayed rows' look-back), hit at any block boundary.
    assert specs["tokens"].prefix_cacheable and getattr(specs["tokens"], "sliding_window", None) is None
    assert (harness.model.truncation_mode, harness.model.truncation_keep) == ("compact", KEEP)


def test_replayed_hits_equal_the_reference_at_every_offset(harness, tiny_reference):
    a = _prompt(90, 1)
    _run(harness, "a", a, [37, 53], prompt_len=len(a))
    cached = _global_pages(harness, "a")
    moved = 0
    for hit in HITS:
        b = a[:hit] + _prompt(25, 100 + hit)
        rid = f"b{hit}"
        replay = harness.prefix_hit(rid, "a", hit)
        # The replay and the rest in three chunks: a chunk boundary inside the replay, odd sizes.
        got = _run(harness, rid, replay + b[hit:], [5, 11, 100], prompt_len=len(b))
        want = tiny_reference.forward(
            b, truncation_mode="compact", keep_tokens=KEEP, data_len=len(b), replay_hits=(hit,)
        )
        kept = max(hit, len(b) - KEEP)  # rows past the hit that compact truncation computes
        assert torch.equal(got[kept - (hit - W) :], want[kept:]), f"hit {hit}"
        if hit in (9, 40, 81):
            whole = tiny_reference.forward(b, truncation_mode="compact", keep_tokens=KEEP, data_len=len(b))
            moved += not torch.equal(want[kept:], whole[kept:])
    # The replayed windows change the rows after the hit (the comparison above is not vacuous).
    assert moved == 3
    # Replays rewrite window KV only: the hits' cached compressed KV, index keys and token ids
    # (blocks shared with "a") are byte for byte as "a" computed them.
    for name, pages in _global_pages(harness, "a").items():
        assert torch.equal(pages, cached[name]), name


def _greedy(harness, prompt, n, admissions, chunk=16):
    """Greedy tokens of one request through the paged model; ``admissions`` maps a length to
    the hit with which the request is preempted and re-admitted there (0: recomputed whole)."""
    tokens = list(prompt)
    rid = "r0"
    last = _run(harness, rid, tokens, [30, chunk], prompt_len=len(prompt))[-1]
    new = []
    while len(new) < n:
        tok = int(torch.argmax(last))
        new.append(tok)
        tokens.append(tok)
        if len(tokens) in admissions:
            hit, old = admissions[len(tokens)], rid
            rid = f"r{len(tokens)}"
            todo = harness.prefix_hit(rid, old, hit) + tokens[hit:] if hit else tokens
            last = _run(harness, rid, todo, [chunk] * 20, prompt_len=len(prompt))[-1]
        else:
            last = harness.step([(rid, [tok])], prompt_lens=[len(prompt)])[-1]
    return new


def test_preemptions_and_chained_hits_give_the_reference_tokens(harness, tiny_reference):
    """Preempted requests come back with a hit on their own cached blocks (prompt and generated
    tokens), replay, and go on; a later hit keeps the earlier one's entries below it, a
    re-admission without a hit starts over."""
    prompt = _prompt(44, 2)
    admissions = {50: 48, 55: 33, 58: 0, 63: 57}  # length at re-admission -> hit
    got = _greedy(harness, prompt, 24, admissions)
    in_order = [(admissions[at], at) for at in sorted(admissions)]
    want = tiny_reference.greedy_generate(
        prompt, 24, truncation_mode="compact", keep_tokens=KEEP, admissions=in_order
    )
    assert got == want
    # Without the replays the reference continues differently: the hits matter to the tokens.
    plain = tiny_reference.greedy_generate(prompt, 24, truncation_mode="compact", keep_tokens=KEEP)
    assert plain != want


@pytest.mark.parametrize("mode", ["mask", "off"])
def test_replay_under_each_truncation_mode(tiny_checkpoint, tiny_reference, monkeypatch, single_thread, mode):
    """``mask`` computes the rows ``compact`` drops; both equal the reference in their mode (so
    ``compact`` is ``mask`` on the kept rows, replay included); ``off`` is replay alone."""
    monkeypatch.setenv("DEEPINFER_PREFILL_TRUNCATION_MODE", mode)
    harness = PagedHarness(tiny_checkpoint, dtype="float32", swa_bounded_replay=True)
    a = _prompt(90, 3)
    _run(harness, "a", a, [50, 40], prompt_len=len(a))
    for hit in (17, 64):
        b = a[:hit] + _prompt(40, 200 + hit)
        replay = harness.prefix_hit(f"b{hit}", "a", hit)
        got = _run(harness, f"b{hit}", replay + b[hit:], [7, 64], prompt_len=len(b))
        want = tiny_reference.forward(
            b, truncation_mode=mode, keep_tokens=KEEP, data_len=len(b), replay_hits=(hit,)
        )
        assert torch.equal(got[W:], want[hit:]), f"hit {hit}"


def test_dspark_context_keys_are_rebuilt_by_the_replay(tiny_checkpoint, tiny_reference, single_thread):
    """The replayed rows rewrite the DSpark stages' context keys (window caches, not cached): the
    draft after a hit equals the reference drafter on the replayed target features."""
    from deepinfer_vllm.reference.dspark import ReferenceDSpark

    k = 3
    harness = PagedHarness(
        tiny_checkpoint,
        dtype="float32",
        swa_bounded_replay=True,
        speculative_config={"method": "dspark", "num_speculative_tokens": k},
    )
    drafter = ReferenceDSpark.from_pretrained(tiny_reference, tiny_checkpoint)
    a = _prompt(70, 4)
    _run(harness, "a", a, [70], prompt_len=len(a))
    hit = 48
    b = a[:hit] + [11, 12, 13, 14, 15]  # the draft's context window reaches into the replay
    _run(harness, "b", harness.prefix_hit("b", "a", hit) + b[hit:], [13], prompt_len=len(b))
    hh, base = harness.draft_block(["b"], [777], k)

    trace = ForwardTrace()
    tiny_reference.hidden_states(
        b, truncation_mode="compact", keep_tokens=KEEP, data_len=len(b), replay_hits=(hit,), trace=trace
    )
    anchor = torch.tensor([len(b) - 1])
    ctx = context_window(anchor, W)[0][0]
    rows = []
    for L in tiny_reference.arch.dspark_target_layer_ids:
        where = {int(p): i for i, p in enumerate(trace.entry_positions[L])}
        rows.append(trace.entry_streams[L][[where[int(p)] for p in ctx]])
    main = drafter.main(target_features(rows)).unsqueeze(0)
    want_hh, want_base = drafter.block_outputs(main, torch.tensor([777]), anchor, k)
    torch.testing.assert_close(base, want_base, rtol=0, atol=1e-5)
    torch.testing.assert_close(hh, want_hh, rtol=0, atol=1e-6)
    # Drafting from the keys the first computation wrote (no replay) would differ.
    stale = drafter.draft_greedy(b, 777, k)
    assert not torch.allclose(stale.base, want_base, rtol=0, atol=1e-3)
