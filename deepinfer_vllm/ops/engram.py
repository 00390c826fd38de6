"""Engram conditional-memory references (docs/architecture.md, "Engram"; docs/design-notes.md, "Engram").

Pieces:
  * tokenizer-derived compressed vocabulary (``normalize_token_text``,
    ``compressed_vocab_from_tokenizer``, ``compress_token_ids``);
  * table layout: globally distinct primes, per-column offsets, odd hash multipliers;
  * per-token n-gram id windows (``engram_ngram_ids``) and the XOR-rolling hash
    (``engram_hash``);
  * the signed-sqrt sigmoid gate that injects the projected memory into the residual
    streams (``engram_gate_update``).

Sentinels in compressed-id space (all real compressed ids are >= 0):
  * ``ENGRAM_DEAD = -1``: a token that cannot take part in an n-gram (an image token, or a raw
    id outside the tokenizer's table; DeepInfer's ``IMAGE_SENTINEL``);
  * ``ENGRAM_BEFORE_START = -2``: a look-back slot before position 0 of the sequence.
Both set the hash's "blocked" flag, after which every older slot is replaced by ``pad_id``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .numerics import acc_dtype, device_constant, pointwise

__all__ = [
    "ENGRAM_BEFORE_START",
    "ENGRAM_DEAD",
    "compress_token_ids",
    "compressed_vocab_from_tokenizer",
    "engram_gate_update",
    "engram_hash",
    "engram_history_windows",
    "engram_multipliers",
    "engram_ngram_ids",
    "engram_offsets",
    "engram_primes",
    "next_prime",
    "normalize_token_text",
]

ENGRAM_DEAD = -1
ENGRAM_BEFORE_START = -2

# ---------------------------------------------------------------------------------------------
# 8.1 Token-id compression
# ---------------------------------------------------------------------------------------------

_WS_RUN = re.compile(r"[ \t\r\n]+")
_PROTECT = "\ue000"
# The HF ``tokenizers`` Strip normaliser trims Rust's ``char::is_whitespace`` set (Unicode
# White_Space). Python's ``str.strip()`` would also trim U+001C..U+001F, so list it explicitly.
_STRIP_CHARS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


def normalize_token_text(text: str) -> str:
    """The key normalisation ("Token-id compression") of one decoded token text (U+FFFD handling
    is the caller's).

    Steps, mirroring the ``tokenizers`` normaliser sequence DeepInfer builds:
      1. NFKC, then NFD;
      2. strip accents: drop every combining mark. NOTE: ``tokenizers``' StripAccents drops all
         of General_Category M (Mn, Mc and Me), not only Mn; DeepInfer uses it, so we do too;
      3. lowercase character by character (full per-char mapping, e.g. U+0130 -> "i\\u0307";
         no context-dependent final sigma, unlike ``str.lower()`` on a whole string);
      4. collapse runs of [ \\t\\r\\n] to one space;
      5. a text that is exactly one space is protected as U+E000;
      6. strip Unicode White_Space at both ends;
      7. every U+E000 becomes a space again (DeepInfer replaces all of them, including any U+E000
         that was in the token itself; we do the same).
    Returns the normalised text, or ``text`` unchanged if the result is empty.
    Unicode-table versions of Python's ``unicodedata`` and the Rust crates can disagree on code
    points assigned recently; the class-count check (99092 for Flash) guards the real vocab.
    """
    if text.isascii():
        t = text.lower()  # NFKC/NFD/accent stripping are the identity on ASCII
    else:
        t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        t = "".join(ch.lower() for ch in t if not unicodedata.category(ch).startswith("M"))
    t = _WS_RUN.sub(" ", t)
    if t == " ":
        t = _PROTECT
    t = t.strip(_STRIP_CHARS).replace(_PROTECT, " ")
    return t or text


def _decode_all(tokenizer) -> tuple[list[str], Callable[[int], str | None]]:
    """Decode every id of the tokenizer on its own (special tokens kept, no clean-up).

    Returns the texts and a function id -> raw token string. Works with a
    ``tokenizers.Tokenizer`` or a HF ``PreTrainedTokenizerBase`` (fast ones go through their
    backend ``tokenizers.Tokenizer``, which is what their ``decode`` calls; slow ones are decoded
    one id at a time with ``clean_up_tokenization_spaces=False``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch") and hasattr(tokenizer, "get_vocab_size"):
        backend = tokenizer
    if backend is not None:
        n = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return texts, backend.id_to_token
    n = len(tokenizer)
    texts = [
        tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in range(n)
    ]
    return texts, tokenizer.convert_ids_to_tokens


def compressed_vocab_from_tokenizer(tokenizer, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:
    """Build ``old2new`` (raw id -> compressed id) and the number of classes ("Token-id compression").

    Every id ``0 .. tokenizer_vocab-1`` (added/special tokens included) is decoded alone. If the
    text contains U+FFFD (a partial UTF-8 byte piece) its key is the raw token string, otherwise
    ``normalize_token_text(text)``. Distinct keys get consecutive ids in ascending raw-id order
    (raw-string keys and normalised keys share one key space, as in DeepInfer).

    Ids the tokenizer does not know: DeepInfer keeps a table of the tokenizer's length and maps
    any raw id outside it to ``ENGRAM_DEAD`` (its image sentinel) when encoding. We follow that:
    the returned table has the tokenizer's length; if ``vocab_size`` (the model's vocabulary) is
    larger, the table is padded with ``ENGRAM_DEAD`` up to it. Either way those ids are dead for
    hashing and do NOT count as classes. Use ``compress_token_ids`` to encode.
    """
    texts, id_to_token = _decode_all(tokenizer)
    keys: dict[str, int] = {}
    table = np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = id_to_token(i)
            if key is None:
                raise ValueError(f"token id {i} has no raw string")
        else:
            key = normalize_token_text(text)
        table[i] = keys.setdefault(key, len(keys))
    old2new = torch.from_numpy(table)
    if vocab_size is not None and vocab_size > old2new.numel():
        pad = torch.full((vocab_size - old2new.numel(),), ENGRAM_DEAD, dtype=torch.int64)
        old2new = torch.cat([old2new, pad])
    return old2new, len(keys)


def compress_token_ids(
    token_ids: torch.Tensor,
    old2new: torch.Tensor,
    is_image: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw ids -> compressed ids (int64). Ids outside ``[0, len(old2new))`` and rows flagged
    ``is_image`` become ``ENGRAM_DEAD`` (DeepInfer's rule: out-of-table ids are image sentinels;
    in vLLM image spans carry the in-vocab id 129264, so the caller passes the image mask)."""
    ids = token_ids.long()
    table = old2new.to(ids.device).long()
    inside = (ids >= 0) & (ids < table.numel())
    out = torch.where(inside, table[ids.clamp(0, table.numel() - 1)], torch.full_like(ids, ENGRAM_DEAD))
    if is_image is not None:
        out = torch.where(is_image.bool(), torch.full_like(out, ENGRAM_DEAD), out)
    return out


# ---------------------------------------------------------------------------------------------
# 8.2 / 8.3 Table layout and multipliers
# ---------------------------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for n < 3.3e24 (bases = first 12 primes)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        y = pow(a, d, n)
        if y in (1, n - 1):
            continue
        for _ in range(r - 1):
            y = y * y % n
            if y == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """Smallest prime strictly greater than ``n`` (same contract as ``sympy.nextprime``)."""
    c = max(n + 1, 2)
    while not _is_prime(c):
        c += 1
    return c


def engram_primes(
    layer_ids: Sequence[int],
    max_ngram: int,
    n_heads: int,
    engram_vocab_size: int | Sequence[int],
) -> dict[int, list[list[int]]]:
    """Per Engram layer, per n-gram order (2..max_ngram), per head: a prime table size ("Prime tables").

    Layers in the given order, then orders, then heads; for each order the search restarts at
    ``vocab - 1`` and each head takes the smallest prime above the previous candidate that was
    not handed out before (all primes distinct across layers). ``engram_vocab_size`` may be a
    list with one entry per order.
    """
    n_orders = max_ngram - 1
    if isinstance(engram_vocab_size, int):
        vocab_per_order = [engram_vocab_size] * n_orders
    else:
        vocab_per_order = [int(v) for v in engram_vocab_size]
        if len(vocab_per_order) != n_orders:
            raise ValueError("need one engram vocab size per n-gram order")
    used: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        per_order = []
        for vocab in vocab_per_order:
            cand = vocab - 1
            heads = []
            for _ in range(n_heads):
                cand = next_prime(cand)
                while cand in used:
                    cand = next_prime(cand)
                used.add(cand)
                heads.append(cand)
            per_order.append(heads)
        out[int(layer)] = per_order
    return out


def engram_offsets(primes_of_layer: Sequence[Sequence[int]]) -> list[int]:
    """Exclusive prefix sums over the layer's columns (column ``c = order_idx*n_heads + head``).
    The layer's table has ``offsets[-1] + primes[-1][-1]`` rows (= sum of its primes)."""
    offsets, total = [], 0
    for per_head in primes_of_layer:
        for p in per_head:
            offsets.append(total)
            total += int(p)
    return offsets


def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab_size: int, seed: int = 0) -> list[int]:
    """Odd int64 multipliers of one layer ("Hash multipliers"): NumPy ``default_rng(seed + 10007*layer_id)``,
    ``integers(0, bound, size=max_ngram, dtype=int64)`` with
    ``bound = max(1, (int64_max // compressed_vocab_size) // 2)``, then ``2*v + 1``."""
    bound = max(1, (np.iinfo(np.int64).max // int(compressed_vocab_size)) // 2)
    layer_seed = 10007 * int(layer_id) + int(seed)
    draws = np.random.default_rng(layer_seed).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


# ---------------------------------------------------------------------------------------------
# 8.4 N-gram windows and hash
# ---------------------------------------------------------------------------------------------


def engram_ngram_ids(
    comp_ids: torch.Tensor,
    positions: torch.Tensor,
    lookback: torch.Tensor | None,
    max_ngram: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per token, the compressed ids at positions ``p, p-1, ..., p-(max_ngram-1)`` -> int64
    ``[T, max_ngram]`` (column ``s`` = look-back distance ``s``). No blocking is applied here;
    sentinels are kept (``ENGRAM_DEAD`` as given, ``ENGRAM_BEFORE_START`` for ``p - s < 0``) and
    ``engram_hash`` turns them into the blocked/pad rule.

    Rows are grouped into chunks: maximal runs of consecutive rows whose positions increase by
    exactly 1 (and whose ``segment_ids`` agree, when given; pass them when two requests of a
    flattened batch could have abutting positions). Within a chunk, look-back reads earlier rows.
    Slots before a chunk's first position come from ``lookback``:
      * ``lookback [T, max_ngram-1]`` (or ``[max_ngram-1]``, broadcast to all rows): for each row,
        the compressed ids of ITS CHUNK's history, nearest first: ``lookback[t, i]`` is the id at
        position ``chunk_start - 1 - i``; entries for negative positions are ignored (may hold
        ``ENGRAM_BEFORE_START``). Serving passes the request's last ``max_ngram-1`` committed
        compressed ids, repeated over the request's rows.
      * ``None``: every chunk must start at position 0 (otherwise ``ValueError``).
    ``max_ngram`` defaults to ``lookback.shape[-1] + 1`` and is required when ``lookback`` is None.
    """
    if max_ngram is None:
        if lookback is None:
            raise ValueError("max_ngram is required when no lookback is given")
        max_ngram = lookback.shape[-1] + 1
    ids = comp_ids.long().view(-1)
    pos = positions.long().view(-1)
    T = ids.numel()
    nb = max_ngram - 1
    dev = ids.device
    rows = torch.arange(T, device=dev)
    starts = torch.ones(T, dtype=torch.bool, device=dev)
    if T > 1:
        cont = pos[1:] == pos[:-1] + 1
        if segment_ids is not None:
            seg = segment_ids.view(-1)
            cont = cont & (seg[1:] == seg[:-1])
        starts[1:] = ~cont
    first_row = torch.where(starts, rows, torch.zeros_like(rows)).cummax(dim=0).values
    offset_in_chunk = rows - first_row  # how many earlier rows of the same chunk exist

    out = torch.empty(T, max_ngram, dtype=torch.int64, device=dev)
    out[:, 0] = ids
    if nb == 0:
        return out
    if lookback is not None:
        lb = lookback.long().to(dev)
        lb = lb.view(1, nb).expand(T, nb) if lb.dim() == 1 else lb.view(T, nb)
    for s in range(1, max_ngram):  # loop over look-back distances, not tokens
        want = pos - s
        in_chunk = offset_in_chunk >= s
        from_rows = ids[(rows - s).clamp_min(0)]
        hist_idx = (s - offset_in_chunk - 1).clamp(0, nb - 1)  # index into lookback when not in chunk
        if lookback is not None:
            from_hist = lb.gather(1, hist_idx.view(-1, 1)).view(-1)
        else:
            missing = (~in_chunk) & (want >= 0)
            if bool(missing.any()):
                raise ValueError("chunk does not start at position 0 and no lookback ids were given")
            from_hist = torch.full_like(ids, ENGRAM_BEFORE_START)
        col = torch.where(in_chunk, from_rows, from_hist)
        col = torch.where(want < 0, torch.full_like(col, ENGRAM_BEFORE_START), col)
        out[:, s] = col
    return out


def engram_history_windows(
    token_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, depth: int
) -> torch.Tensor:
    """Raw ids at ``p, p-1, ..., p-(depth-1)`` of every token, -1 before position 0 -> int64
    ``[T, depth]``, read from a table of every request's ids: ``token_ids [R, L]`` (row ``rows[t]``
    holds the ids of token ``t``'s request by position), ``positions [T]``.

    What a paged token history returns on the device (the model's ``TokenHistory``), computed
    where the ids already are, e.g. vLLM's host token table, so the host can hash without reading
    anything back from the device. Positions at or past ``L`` are refused."""
    rows = rows.long().view(-1, 1)
    positions = positions.long().view(-1, 1)
    if positions.numel() and int(positions.max()) >= token_ids.shape[1]:
        raise ValueError(
            f"position {int(positions.max())} outside the token table ({token_ids.shape[1]} ids per request)"
        )
    back = positions - torch.arange(depth, dtype=torch.int64, device=positions.device)
    ids = token_ids[rows, back.clamp_min(0)].long()
    return torch.where(back >= 0, ids, torch.full_like(ids, -1))


_INT64_MAX = (1 << 63) - 1


def engram_hash(
    ngram_ids: torch.Tensor,
    pad_id: int,
    multipliers: Sequence[int],
    primes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    id_bound: int | None = None,
) -> torch.Tensor:
    """Row indices into one layer's Engram table ("N-gram hash") -> int64 ``[T, (max_ngram-1)*n_heads]``.

    For look-back ``s = 0..max_ngram-1``: ``blocked |= ngram_ids[:, s] < 0`` (a dead token or a
    slot before the sequence start; sticky), ``v = pad_id if blocked else id``,
    ``rolling ^= v * multipliers[s]``; for ``s >= 1`` column ``(s-1)*n_heads + h`` is
    ``rolling mod primes[s-1][h] + offsets[...]``.

    Overflow: with compressed vocab ``V`` every id (and pad) is in ``[0, V)`` and every multiplier
    is at most ``2*bound - 1 < (2^63-1) // V``, so ``v * mult < 2^63``: products are exact
    non-negative int64, XOR of non-negative int64 stays non-negative, and ``%`` is the plain
    remainder. This is checked against ``id_bound`` (the compressed vocabulary size, all ids
    below it: no look at the ids, so no wait on a device) or, without it, against the actual ids.
    Image rows (``s = 0`` dead) hash an all-pad window; their gate is zero anyway.
    """
    ids = ngram_ids.long()
    T, max_ngram = ids.shape
    if len(multipliers) < max_ngram or len(primes) < max_ngram - 1:
        raise ValueError("not enough multipliers / prime rows for this n-gram size")
    n_heads = len(primes[0])
    if id_bound is not None:
        max_id = max(int(id_bound) - 1, int(pad_id))
    else:
        max_id = max(int(ids.max()) if ids.numel() else 0, int(pad_id))
    if max_id * max(int(m) for m in multipliers[:max_ngram]) > _INT64_MAX:
        raise OverflowError("id * multiplier would overflow int64; ids must be < compressed vocab size")
    dev = ids.device
    blocked = torch.zeros(T, dtype=torch.bool, device=dev)
    rolling = torch.zeros(T, dtype=torch.int64, device=dev)
    cols = []
    for s in range(max_ngram):  # loop over n-gram orders
        blocked = blocked | (ids[:, s] < 0)
        v = torch.where(blocked, torch.full_like(rolling, int(pad_id)), ids[:, s])
        rolling = torch.bitwise_xor(rolling, v * int(multipliers[s]))
        if s >= 1:
            mods = device_constant("engram_primes", tuple(int(p) for p in primes[s - 1]), torch.int64, dev)
            offs = device_constant(
                "engram_offsets",
                tuple(int(offsets[(s - 1) * n_heads + h]) for h in range(n_heads)),
                torch.int64,
                dev,
            )
            cols.append(torch.remainder(rolling.unsqueeze(1), mods) + offs)
    return torch.cat(cols, dim=1)


# ---------------------------------------------------------------------------------------------
# 8.5 Gate
# ---------------------------------------------------------------------------------------------


def engram_gate_update(
    streams: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    is_image: torch.Tensor | None = None,
    clamp: float = 1e-6,
) -> torch.Tensor:
    """Inject the Engram value into every residual stream ("Engram gate"). Returns ``streams.dtype``.

    ``kv [T, (hc+1)*D]``: per-stream keys ``kv[:, i*D:(i+1)*D]`` and the shared value
    ``kv[:, hc*D:]``. All math in fp32:
      ``dot_i = sum_d R_i*qw_i*kw_i*key_i * rsqrt(mean(R_i^2)+eps) * rsqrt(mean(key_i^2)+eps) / sqrt(D)``
      ``gate_i = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, clamp)))`` (sign(0)=0 -> gate 0.5)
      ``R_i <- R_i + gate_i * value``, rounded once to ``streams.dtype``.
    Image rows are returned unchanged (gate 0).
    """
    T, hc, D = streams.shape
    acc = acc_dtype(streams.dtype)
    x = streams.to(acc)
    kvf = kv.to(acc).view(T, hc + 1, D)
    keys = kvf[:, :hc]
    value = kvf[:, hc]
    r_x = torch.rsqrt(x.square().mean(dim=-1) + eps)
    r_k = torch.rsqrt(keys.square().mean(dim=-1) + eps)
    w = (q_weight.to(acc) * k_weight.to(acc)).unsqueeze(0)
    dot = (x * w * keys).sum(dim=-1) * r_x * r_k * (D**-0.5)
    gate = pointwise(torch.sigmoid, torch.sign(dot) * dot.abs().clamp_min(clamp).sqrt())
    out = (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)
    if is_image is not None:
        out = torch.where(is_image.view(T, 1, 1).bool(), streams, out)
    return out
