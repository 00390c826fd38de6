import math
import time

import pytest
import torch

from deepinfer_vllm.ops.engram import (
    ENGRAM_BEFORE_START,
    ENGRAM_DEAD,
    compress_token_ids,
    compressed_vocab_from_tokenizer,
    engram_gate_update,
    engram_hash,
    engram_multipliers,
    engram_ngram_ids,
    engram_offsets,
    engram_primes,
    next_prime,
    normalize_token_text,
)

# ---------------------------------------------------------------- layout / multipliers


def test_multiplier_vectors():
    assert engram_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_multipliers(14, 4, 99092) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    # the tiny config draws 3 from the same stream: the first three of layer 1
    assert engram_multipliers(1, 3, 99092) == engram_multipliers(1, 4, 99092)[:3]
    assert all(m % 2 == 1 for m in engram_multipliers(7, 4, 99092))


def test_flash_primes_and_table_sizes():
    primes = engram_primes([1, 14], 4, 8, 16000000)
    assert primes[1][0][:3] == [16000057, 16000079, 16000081]
    assert primes[14][0][:3] == [16000477, 16000487, 16000499]
    sizes = {lid: sum(sum(order) for order in per) for lid, per in primes.items()}
    assert sizes == {1: 384006168, 14: 384016682}
    flat = [p for per in primes.values() for order in per for p in order]
    assert len(flat) == 48 and len(set(flat)) == 48
    off = engram_offsets(primes[14])
    assert len(off) == 24 and off[0] == 0 and off[-1] + primes[14][-1][-1] == 384016682


def test_tiny_primes_offsets():
    primes = engram_primes([1], 3, 2, 64)
    assert primes == {1: [[67, 71], [73, 79]]}
    off = engram_offsets(primes[1])
    assert off == [0, 67, 138, 211] and off[-1] + 79 == 290


def test_next_prime_against_sympy():
    sympy = pytest.importorskip("sympy")
    for n in list(range(-3, 300)) + [15999999, 16000081, 2**31 - 2, 10**12 + 7, 3215031751 - 1]:
        assert next_prime(n) == sympy.nextprime(n), n


# ---------------------------------------------------------------- hashing

MULT = engram_multipliers(1, 4, 99092)
PRIMES = [[67, 71], [73, 79], [83, 89]]  # 3 orders x 2 heads (max_ngram 4)
OFFS = engram_offsets(PRIMES)
PAD = 5


def _naive_hash(comp, max_ngram, pad_id, mult, primes, offs, history=()):
    """docs/architecture.md, "N-gram hash", verbatim with Python ints; ``history`` = compressed ids
    before comp[0]."""
    full = list(history) + list(comp)
    base = len(history)
    rows = []
    for p in range(base, len(full)):
        blocked, rolling, row = False, 0, []
        for s in range(max_ngram):
            q = p - s
            src = full[q] if q >= 0 else None
            blocked = blocked or q < 0 or src == ENGRAM_DEAD
            v = pad_id if blocked else src
            rolling ^= v * mult[s]
            assert rolling < 2**63
            if s >= 1:
                for h, prime in enumerate(primes[s - 1]):
                    row.append(rolling % prime + offs[(s - 1) * len(primes[0]) + h])
        rows.append(row)
    return rows


def _hash(comp, positions=None, lookback=None, segment_ids=None):
    comp = torch.tensor(comp, dtype=torch.int64)
    pos = torch.arange(len(comp)) if positions is None else torch.tensor(positions)
    ng = engram_ngram_ids(comp, pos, lookback, 4, segment_ids=segment_ids)
    return engram_hash(ng, PAD, MULT, PRIMES, OFFS)


def test_hash_matches_python_ints():
    comp = [17, 99091, 0, 4242, 17, 99091, 7, 7, 7, 12345]
    out = _hash(comp)
    assert out.dtype == torch.int64 and out.shape == (10, 6)
    assert out.tolist() == _naive_hash(comp, 4, PAD, MULT, PRIMES, OFFS)
    # column ranges: column c lies inside [offset_c, offset_c + prime_c)
    flat_p = [p for order in PRIMES for p in order]
    for c in range(6):
        assert ((out[:, c] >= OFFS[c]) & (out[:, c] < OFFS[c] + flat_p[c])).all()


def test_ngram_window_columns():
    ng = engram_ngram_ids(torch.tensor([10, 11, 12]), torch.arange(3), None, 4)
    B = ENGRAM_BEFORE_START
    assert ng.tolist() == [[10, B, B, B], [11, 10, B, B], [12, 11, 10, B]]


def test_dead_token_blocks_ngrams():
    comp = [21, 22, ENGRAM_DEAD, 23, 24, 25]
    out = _hash(comp)
    assert out.tolist() == _naive_hash(comp, 4, PAD, MULT, PRIMES, OFFS)
    # after the dead token everything older is pad: identical to a fresh sequence [23, 24, 25]
    fresh = _hash([23, 24, 25])
    assert torch.equal(out[3:], fresh)
    # before it nothing changes
    assert torch.equal(out[:2], _hash([21, 22]))
    # the 2-gram of position 1 still sees 21; the 4-gram of position 4 does not see 22
    assert not torch.equal(_hash([21, 22])[1], _hash([99, 22])[1])
    assert torch.equal(_hash([21, 22, ENGRAM_DEAD, 23, 24])[4], _hash([1, 2, ENGRAM_DEAD, 23, 24])[4])


def test_chunked_hash_with_lookback_equals_full():
    comp = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    full = _hash(comp)
    for cut in (1, 2, 3, 4, 7):
        hist = comp[:cut][::-1][:3]  # nearest first
        hist = hist + [ENGRAM_BEFORE_START] * (3 - len(hist))
        part = _hash(comp[cut:], positions=list(range(cut, len(comp))), lookback=torch.tensor(hist))
        assert torch.equal(part, full[cut:]), cut
    # lookback is required when a chunk does not start at position 0
    with pytest.raises(ValueError):
        _hash(comp[4:], positions=list(range(4, len(comp))))


def test_flattened_batch_with_two_requests():
    a = [8, 9, 10, 11, 12]
    b = [40, 41, 42, 43]
    # request A: positions 3..7 (history [2, 1, 0] before it); request B: positions 8..11 (abutting!)
    hist_a = [7, 6, 5]
    hist_b = [33, 32, 31]
    lb = torch.tensor([hist_a] * 5 + [hist_b] * 4)
    seg = torch.tensor([0] * 5 + [1] * 4)
    out = _hash(a + b, positions=list(range(3, 8)) + list(range(8, 12)), lookback=lb, segment_ids=seg)
    want_a = _naive_hash(a, 4, PAD, MULT, PRIMES, OFFS, history=[5, 6, 7])
    want_b = _naive_hash(b, 4, PAD, MULT, PRIMES, OFFS, history=[99, 31, 32, 33])  # long enough history
    assert out[:5].tolist() == want_a and out[5:].tolist() == want_b


def test_hash_overflow_guard():
    with pytest.raises(OverflowError):
        engram_hash(torch.tensor([[200000, 1, 1, 1]]), PAD, MULT, PRIMES, OFFS)


# ---------------------------------------------------------------- gate


def _naive_gate(streams, kv, qw, kw, eps, image):
    T, hc, D = streams.shape
    out = streams.double().clone()
    for t in range(T):
        if image[t]:
            continue
        val = kv[t, hc * D:].double()
        for i in range(hc):
            x = streams[t, i].double()
            k = kv[t, i * D:(i + 1) * D].double()
            rh = 1 / math.sqrt((x * x).mean().item() + eps)
            rk = 1 / math.sqrt((k * k).mean().item() + eps)
            dot = (x * qw[i].double() * kw[i].double() * k).sum().item() * rh * rk / math.sqrt(D)
            sq = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot) if dot != 0 else 0.0
            out[t, i] = x + val / (1 + math.exp(-sq))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_update(dtype):
    g = torch.Generator().manual_seed(5)
    T, hc, D = 4, 4, 32
    streams = torch.randn(T, hc, D, generator=g).to(dtype)
    kv = torch.randn(T, (hc + 1) * D, generator=g).to(dtype)
    qw = (torch.rand(hc, D, generator=g) + 0.5).to(torch.bfloat16)
    kw = (torch.rand(hc, D, generator=g) + 0.5).to(torch.bfloat16)
    image = torch.tensor([False, True, False, False])
    out = engram_gate_update(streams, kv, qw, kw, 1e-20, is_image=image)
    assert out.dtype == dtype
    assert torch.equal(out[1], streams[1])  # image token: gate 0, untouched
    ref = _naive_gate(streams, kv, qw, kw, 1e-20, image.tolist())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_gate_value_formula_small_dot():
    # orthogonal stream/key -> dot 0 -> gate sigmoid(0) = 0.5; tiny |dot| uses the 1e-6 clamp
    D = 4
    streams = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    kv = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]])
    ones = torch.ones(1, D)
    out = engram_gate_update(streams, kv, ones, ones, 1e-20)
    torch.testing.assert_close(out, torch.tensor([[[2.0, 1.0, 1.0, 1.0]]]))
    kv2 = torch.tensor([[-1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]])
    out2 = engram_gate_update(streams, kv2, ones, ones, 1e-20)
    # dot = -1 * 2 * 2 / 2 = -2 -> gate = sigmoid(-sqrt(2))
    gate = 1 / (1 + math.exp(math.sqrt(2.0)))
    torch.testing.assert_close(out2[0, 0, 1:], torch.full((3,), 2 * gate))


# ---------------------------------------------------------------- vocabulary compression


@pytest.mark.parametrize(
    "text,want",
    [
        ("Café", "cafe"),
        ("ÉCOLE", "ecole"),
        ("Hello World", "hello world"),
        ("  a\t\t\n b  ", "a b"),
        (" ", " "),            # a single space is protected
        ("\n", " "),           # collapses to one space, then protected
        ("\r\n\t ", " "),
        ("  x", "x"),
        ("ΟΔΟΣ", "οδοσ"),      # per-character lowercase: no final sigma
        ("İ", "i"),            # NFD splits U+0130 into I + U+0307, the dot is stripped before lowercasing
        ("ﬁ", "fi"),           # NFKC
        ("Ａ", "a"),
        ("\u0301", "\u0301"),  # lone accent normalises to empty -> original text kept
        ("\x0b", "\x0b"),      # VT: stripped (not collapsed) -> empty -> original
        ("\x1c", "\x1c"),      # not Unicode White_Space: kept
        ("a\u3000", "a"),      # ideographic space -> NFKC space -> stripped
        ("x\ue000y", "x y"),   # every U+E000 becomes a space (DeepInfer restore step)
        ("क़ि", "क"),          # nukta (Mn) and vowel sign I (Mc) both dropped, like tokenizers' StripAccents
    ],
)
def test_normalize_cases(text, want):
    assert normalize_token_text(text) == want


def _oracle_normalizer():
    tokenizers = pytest.importorskip("tokenizers")
    n = tokenizers.normalizers
    return n.Sequence([
        n.NFKC(), n.NFD(), n.StripAccents(), n.Lowercase(),
        n.Replace(tokenizers.Regex(r"[ \t\r\n]+"), " "),
        n.Replace(tokenizers.Regex(r"^ $"), "\ue000"),
        n.Strip(), n.Replace("\ue000", " "),
    ])


def test_normalize_matches_tokenizers_pipeline():
    import random
    import unicodedata

    oracle = _oracle_normalizer()
    old = unicodedata.ucd_3_2_0  # characters assigned long ago: no Unicode-version skew
    pool = [chr(c) for c in range(0x20, 0x3000) if old.category(chr(c)) not in ("Cn", "Cs", "Co")]
    pool += list(" \t\n\r  \u00a0\u3000\u0301\u0903") * 20
    rng = random.Random(0)
    for _ in range(3000):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
        want = oracle.normalize_str(s) or s
        assert normalize_token_text(s) == want, repr(s)


def _byte_level_tokenizer(extra=()):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models

    # byte-level spellings: "Ġ" = space, "Ċ" = newline, "ĉ" = tab, "Ã©" = é (C3 A9), "Ã" alone = a partial byte
    words = ["<pad0>", "<eos>", "<｜▁pad▁｜>", "CafÃ©", "cafe", "CAFE", "ĠCafÃ©", "Ġcafe", "Ġ", "Ċ", "ĠĠ",
             "ĉ", "Ã", "Â", "hello", "HELLO", "ĠHello", "Hello", "Ã©", "e"] + list(extra)
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad0>"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<｜deepseek_image｜>"])
    return tok, words


def _naive_classes(tok, oracle):
    keys, table = {}, []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (oracle.normalize_str(text) or text)
        table.append(keys.setdefault(key, len(keys)))
    return table, len(keys)


def test_compressed_vocab_small_tokenizer():
    tok, words = _byte_level_tokenizer()
    old2new, n = compressed_vocab_from_tokenizer(tok)
    table, n_ref = _naive_classes(tok, _oracle_normalizer())
    assert old2new.dtype == torch.int64 and old2new.tolist() == table and n == n_ref
    idx = {w: i for i, w in enumerate(words)}
    same = lambda a, b: old2new[idx[a]] == old2new[idx[b]]  # noqa: E731
    assert same("CafÃ©", "cafe") and same("cafe", "CAFE") and same("ĠCafÃ©", "cafe") and same("Ġcafe", "cafe")
    assert same("hello", "HELLO") and same("ĠHello", "hello")
    assert same("Ġ", "Ċ") and same("Ġ", "ĠĠ") and same("Ġ", "ĉ")  # all whitespace-only -> " "
    assert not same("Ã", "Â")  # partial UTF-8 bytes keep their raw spelling (U+FFFD rule)
    assert same("Ã©", "e")
    assert old2new.tolist()[:3] == [0, 1, 2]  # first-seen order
    assert old2new[-1] == n - 1  # the added special token is a class of its own
    # a HF wrapper of the same tokenizer gives the same table
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    o2, n2 = compressed_vocab_from_tokenizer(hf)
    assert torch.equal(o2, old2new) and n2 == n
    # model vocab larger than the tokenizer: the extra ids are dead, not classes
    o3, n3 = compressed_vocab_from_tokenizer(tok, vocab_size=len(table) + 3)
    assert n3 == n and o3[-3:].tolist() == [ENGRAM_DEAD] * 3


def test_compress_token_ids():
    old2new = torch.tensor([0, 1, 1, 2])
    ids = torch.tensor([3, 2, 4, -1, 0, 1])
    out = compress_token_ids(ids, old2new, is_image=torch.tensor([False, False, False, False, True, False]))
    assert out.tolist() == [2, 1, ENGRAM_DEAD, ENGRAM_DEAD, ENGRAM_DEAD, 1]


def test_compressed_vocab_is_fast():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    alpha = sorted(ByteLevel.alphabet())
    words = alpha + [a + b for a in alpha for b in alpha]  # 65 792 one- and two-byte pieces
    words += [a + b + c for a in alpha[:16] for b in alpha for c in alpha[:16]][: 130000 - len(words)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
    tok.decoder = decoders.ByteLevel()
    t0 = time.perf_counter()
    old2new, n = compressed_vocab_from_tokenizer(tok)
    assert time.perf_counter() - t0 < 5.0
    assert old2new.shape == (130000,) and 0 < n <= 130000 and int(old2new.max()) == n - 1
