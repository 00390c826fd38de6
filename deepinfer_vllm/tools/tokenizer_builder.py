"""Offline, deterministic tokenizers for random-weight V4.1 checkpoints.

The real tokenizer is not needed to exercise the model, but its *layout* is:
Engram derives its compressed vocabulary from the tokenizer ("Token-id compression"), chat
encoding and the tool parser look for the V4.1 special strings ("Tokenizer and chat format";
both in docs/architecture.md), and
DSpark/vision use fixed ids (noise 128799, image 129264). ``build_v41_tokenizer``
makes a byte-level BPE with exactly ``vocab_size`` ids and that layout, built
from a word list in this module, with no network access:

* ids 0/1/2: BOS, EOS, pad;
* ids 3..258: the 256 byte symbols;
* then English words (lower case, capitalised, with and without a leading
  space), suffixes, numbers, every 2- and 3-letter string and as many 4-letter
  strings as needed to fill the learned range;
* from 128000 (for the full 129280-id vocab): reserved placeholders, the
  noise token at 128799 (a placeholder, as in DeepSeek-V3-style vocabularies),
  the chat/task/DSML strings at 128800.. and ``<｜deepseek_image｜>`` at 129264.
  Smaller vocabularies put the named tokens at the top of the id range.

Merges are the left-to-right prefix chains of every learned token and the
model matches whole pre-tokens against the vocab first (``ignore_merges``), so
common words are one id and any text round-trips through byte fallback.
``build_wordlevel_tokenizer`` is a plain word-level tokenizer without any chat
tokens, for checking that a checkpoint loads without them.
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = [
    "BOS_TOKEN",
    "CHAT_TOKENS",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "IMAGE_TOKEN_ID",
    "NOISE_TOKEN_ID",
    "PAD_TOKEN",
    "build_v41_tokenizer",
    "build_wordlevel_tokenizer",
    "placeholder_token",
    "save_tokenizer",
]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
IMAGE_TOKEN_ID = 129264
NOISE_TOKEN_ID = 128799
FULL_VOCAB_SIZE = 129280
RESERVED_START = 128000  # first reserved id of the full-size vocabulary
CHAT_BASE_ID = 128800

# Every V4.1 special string (roles, reasoning, tasks, DSML tool-call markers): docs/architecture.md,
# "Tokenizer and chat format".
CHAT_TOKENS = (
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜DSML｜",
    "</｜DSML｜",
)

WORDLEVEL_SPECIALS = ("<s>", "</s>", "<pad>", "<unk>")

# Frequent English words (function words first), written for this module.
_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among grand ball yet
wave drop heart present heavy dance engine position arm wide sail material size vary settle speak
weight general ice matter circle pair include divide syllable felt perhaps pick sudden count square
reason length represent art subject region energy hunt probable bed brother egg ride cell believe
fraction forest sit race window store summer train sleep prove lone leg exercise wall catch mount
wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower clothe strange gone jump
baby eight village meet root buy raise solve metal whether push seven paragraph third shall held
hair describe cook floor either result burn hill safe cat century consider type law bit coast copy
phrase silent tall sand soil roll temperature finger industry value fight lie beat excite natural
view sense ear else quite broke case middle kill son lake moment scale loud spring observe child
straight consonant nation dictionary milk speed method organ pay age section dress cloud surprise
quiet stone tiny climb cool design poor lot experiment bottom key iron single stick flat twenty
skin smile crease hole trade melody trip office receive row mouth exact symbol die least trouble
shout except wrote seed tone join suggest clean break lady yard rise bad blow oil blood touch grew
cent mix team wire cost lost brown wear garden equal sent choose fell fit flow fair bank collect
save control decimal gentle woman captain practice separate difficult doctor please protect noon
whose locate ring character insect caught period indicate radio spoke atom human history effect
electric expect crop modern element hit student corner party supply bone rail imagine provide
agree thus capital chair danger fruit rich thick soldier process operate guess necessary sharp
wing create neighbor wash bat rather crowd corn compare poem string bell depend meat rub tube
famous dollar stream fear sight thin triangle planet hurry chief colony clock mine tie enter major
fresh search send yellow gun allow print dead spot desert suit current lift rose continue block
chart hat sell success company subtract event particular deal swim term opposite wife shoe
shoulder spread arrange camp invent cotton born determine quart nine truck noise level chance
gather shop stretch throw shine property column molecule select wrong gray repeat require broad
prepare salt nose plural anger claim continent oxygen sugar death pretty skill women season
solution magnet silver thank branch match suffix especially fig afraid huge sister steel discuss
forward similar guide experience score apple bought led pitch coat mass card band rope slip win
dream evening condition feed tool total basic smell valley nor double seat arrive master track
parent shore division sheet substance favor connect post spend chord fat glad original share
station dad bread charge proper bar offer segment slave duck instant market degree populate chick
dear enemy reply drink occur support speech nature range steam motion path liquid log meant
quotient teeth shell neck hello hi thanks please sorry yes okay model data code file function
return value true false none null string number list table query answer user assistant system
computer program language python token text input output image video model training learning
network neural layer attention memory cache server request response error message test result
"""
_WORDS = _WORD_TEXT.split()

_SUFFIX_TEXT = """
s es ed ing er ers est ly ness ment ments tion tions sion able ible ful less ous ive al ial ity
ize ise ized ism ist ists ship hood ward wise en ence ance ant ent ic ical ure age ery ory
"""
_SUFFIXES = _SUFFIX_TEXT.split()

_PUNCTUATION = (
    ["...", "--", "==", "()", ");", "),", '"', '",', '."']
    + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
    + [" (", ' "', " -", " --", " =", " ==", " +", " *", " /", " {", " }", " [", " ]"]
    + [" <", " >", " &", " '", " $", " #", " @", " |", " :"]
    + ["\n\n", "  ", "   ", "    ", "\t", "\n "]
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves,
    the other 68 bytes to code points 256.. in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_CHARS = _bytes_to_unicode()


def _to_symbols(text: str) -> str:
    """Text -> its byte-level token string."""
    return "".join(_BYTE_CHARS[b] for b in text.encode("utf-8"))


def placeholder_token(index: int) -> str:
    """Reserved special token ``index`` (the DeepSeek-V3-style placeholder name)."""
    return f"<｜place▁holder▁no▁{index}｜>"


def _candidate_texts() -> itertools.chain[str]:
    """Learned-token texts in priority order (earlier ones survive small vocabularies)."""

    def variants(words: list[str]) -> list[str]:
        out = []
        for w in words:
            cap = w[:1].upper() + w[1:]
            out += [" " + w, w, " " + cap, cap]
        return out

    letters = string.ascii_lowercase
    two = ["".join(p) for p in itertools.product(letters, repeat=2)]
    three = ["".join(p) for p in itertools.product(letters, repeat=3)]
    numbers = [str(i) for i in range(1000)]
    return itertools.chain(
        _PUNCTUATION,
        variants(_WORDS),
        _SUFFIXES,
        numbers,
        (" " + n for n in numbers),
        variants(two),
        variants(three),
        # Filler: space-prefixed 4-letter strings, as many as the range needs.
        (" " + "".join(p) for p in itertools.product(letters, repeat=4)),
    )


def _learned_tokens(capacity: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Up to ``capacity`` multi-symbol tokens (prefix-closed) and their merges."""
    tokens: list[str] = []
    seen: set[str] = set()

    def add(symbols: str) -> bool:
        """Add a token after its prefixes; False once the range is full."""
        if len(symbols) < 2 or symbols in seen:
            return True
        if not add(symbols[:-1]):
            return False
        if len(tokens) >= capacity:
            return False
        seen.add(symbols)
        tokens.append(symbols)
        return True

    for text in _candidate_texts():
        if not add(_to_symbols(text)):
            break
    # Short merges first, as a trained BPE would rank them.
    ranked = sorted(range(len(tokens)), key=lambda i: (len(tokens[i]), i))
    merges = [(tokens[i][:-1], tokens[i][-1]) for i in ranked]
    return tokens, merges


def _reserved_layout(vocab_size: int) -> tuple[int, dict[int, tuple[str, bool]]]:
    """First reserved id and the named reserved tokens: id -> (content, is_special).

    Every other reserved id holds ``placeholder_token(id - first_reserved)``;
    the DSpark noise token is simply the placeholder at its id.
    """
    if vocab_size >= FULL_VOCAB_SIZE:
        start = RESERVED_START
        noise_id, image_id, chat_ids = NOISE_TOKEN_ID, IMAGE_TOKEN_ID, range(CHAT_BASE_ID, vocab_size)
    else:
        # Small vocabularies: chat strings, noise and image occupy the top ids.
        start = vocab_size - len(CHAT_TOKENS) - 2
        chat_ids = range(start, vocab_size)
        noise_id, image_id = vocab_size - 2, vocab_size - 1
    named = {i: (text, False) for i, text in zip(chat_ids, CHAT_TOKENS)}
    named[noise_id] = (placeholder_token(noise_id - start), True)
    named[image_id] = (IMAGE_TOKEN, True)
    return start, named


_LEARNED_START = 3 + 256


def build_v41_tokenizer(vocab_size: int = FULL_VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE with exactly ``vocab_size`` ids and the V4.1 special-token layout."""
    if vocab_size < _LEARNED_START + len(CHAT_TOKENS) + 2 + 64:
        raise ValueError(f"vocab_size {vocab_size} is too small for the byte alphabet and special tokens")
    reserved_start, named = _reserved_layout(vocab_size)
    tokens, merges = _learned_tokens(reserved_start - _LEARNED_START)

    vocab: dict[str, int] = {BOS_TOKEN: 0, EOS_TOKEN: 1, PAD_TOKEN: 2}
    for b in range(256):
        vocab[_BYTE_CHARS[b]] = 3 + b
    for i, token in enumerate(tokens):
        vocab[token] = _LEARNED_START + i
    reserved: list[tuple[str, bool]] = []
    for token_id in range(reserved_start, vocab_size):
        content, special = named.get(token_id, (placeholder_token(token_id - reserved_start), True))
        vocab[content] = token_id
        reserved.append((content, special))
    if len(vocab) != vocab_size or len(set(vocab.values())) != vocab_size:
        raise AssertionError(f"built {len(vocab)} ids instead of {vocab_size}")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, 0)],
    )
    # Registering vocab entries as added tokens keeps their ids; it makes them
    # match as whole strings in text (and special ones skippable on decode).
    specials = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN] + [c for c, special in reserved if special]
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in specials])
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for c, special in reserved if not special])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError("added tokens changed the vocabulary size")
    return tok


def build_wordlevel_tokenizer(vocab_size: int = FULL_VOCAB_SIZE) -> Tokenizer:
    """Whitespace/punctuation word-level tokenizer with ``<s> </s> <pad> <unk>`` only."""
    vocab: dict[str, int] = {t: i for i, t in enumerate(WORDLEVEL_SPECIALS)}
    words = itertools.chain(
        _WORDS,
        (w.capitalize() for w in _WORDS),
        string.punctuation,
        (str(i) for i in range(1000)),
        (f"w{i}" for i in itertools.count()),
    )
    for word in words:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in WORDLEVEL_SPECIALS])
    return tok


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    so that ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads a fast tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    if tokenizer.token_to_id(BOS_TOKEN) == 0:
        bos, eos, pad, unk = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, None
    else:
        bos, eos, pad, unk = WORDLEVEL_SPECIALS
    special_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    if unk is not None:
        special_map["unk_token"] = unk
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,  # BOS comes from tokenizer.json's post-processor
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
