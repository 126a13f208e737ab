"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` Tokenizer (tokenizer.json).

A GGUF carries no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``), the
BPE merges (or SentencePiece scores), each token's type (1 normal, 3 control, 4
user-defined, 6 byte), the special token ids and the name of llama.cpp's pre-tokenizer
(``tokenizer.ggml.pre``, how text is split before BPE). Two families are rebuilt: byte-level
BPE (``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM, Llama 3, Qwen 2) and SentencePiece
BPE (``"llama"``: Llama 2, Mistral; see :func:`_sentencepiece`); others are refused with
one line.

Pre-tokenizers (llama.cpp's split rules, written as ``tokenizers`` pre-tokenizers):

- ``smollm`` (and the StarCoder family): every digit on its own, then GPT-2's split -- the
  same as SmolLM2's own tokenizer.json (``Digits(individual_digits)`` + ``ByteLevel``);
- ``llama-bpe`` / ``llama3`` ... and ``qwen2`` ...: their split regex, then byte-level;
- ``gpt2`` / ``default`` / absent: GPT-2's split. An unknown name also gets GPT-2's split,
  and :func:`build_tokenizer` returns a note saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpool.engine.gguf.read import GGUFError

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
_REGEX_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_GPT2_NAMES = ("gpt2", "gpt-2", "default")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")

CONTROL, USER_DEFINED = 3, 4


@dataclass
class GGUFTokenizer:
    """The rebuilt tokenizer and what tokenizer_config.json needs about it."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None
    eos_token_ids: list[int]  # eos first, then end-of-turn ids the file names (eot, eom)
    notes: list[str] = field(default_factory=list)


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's bytes_to_unicode table: byte -> the printable character that spells it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(meta: Mapping[str, Any]) -> GGUFTokenizer:
    """The tokenizer of a GGUF file's metadata ``meta`` (``GGUFFile.metadata``).

    Raises:
        GGUFError: no vocabulary, a tokenizer model other than ``gpt2`` (byte-level BPE)
            or ``llama`` (SentencePiece BPE), or special token ids outside the vocabulary.
    """
    model = meta.get("tokenizer.ggml.model")
    stored = meta.get("tokenizer.ggml.tokens")
    if not stored:
        raise GGUFError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is absent)")
    if model not in ("gpt2", "llama"):
        raise GGUFError(f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2', "
                        "byte-level BPE; 'llama', SentencePiece BPE)")
    tokens: list[str] = [str(t) for t in stored]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    notes: list[str] = []
    if model == "gpt2":
        tok, vocab = _byte_level(meta, tokens, types, notes)
    else:
        tok, vocab = _sentencepiece(meta, tokens, types)
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFError(f"tokenizer.ggml.{key} = {i} is outside the vocabulary "
                            f"({len(tokens)} tokens)")
        return tokens[int(i)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = (bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
               and bos is not None)
    tok.post_processor = _post_processor(bos if add_bos else None, vocab, model == "gpt2")
    if tok.get_vocab_size() != len(tokens):
        notes.append(f"the rebuilt vocabulary has {tok.get_vocab_size()} tokens, the file "
                     f"{len(tokens)}")
    eos_ids = [int(meta[f"tokenizer.ggml.{k}"]) for k in
               ("eos_token_id", "eot_token_id", "eom_token_id")
               if meta.get(f"tokenizer.ggml.{k}") is not None]
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(
        tokenizer=tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), add_bos_token=add_bos,
        chat_template=str(template) if template else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)), notes=notes)


def _byte_level(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                notes: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """GPT-2-style byte-level BPE with the file's merges and its pre-tokenizer's split."""
    alphabet, spelling = _byte_alphabet(), _byte_spelling()
    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind not in (CONTROL, USER_DEFINED) and not set(text) <= alphabet:
            text = "".join(spelling[b] for b in text.encode("utf-8"))  # stored as raw text
        vocab.setdefault(text, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for a, b in merges],
                     ignore_merges=pre in _LLAMA3_NAMES)
    tok = Tokenizer(bpe)
    if pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in _GPT2_NAMES:
            notes.append(f"unknown GGUF pre-tokenizer {pre!r}: splitting text like GPT-2")
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int]
                   ) -> tuple[Tokenizer, dict[str, int]]:
    """SentencePiece BPE (Llama 2, Mistral): pieces spell a space as U+2581, unknown bytes
    fall back to the ``<0xXX>`` tokens, and merges come from the file or, when it has none,
    from the pieces' scores (every split of a piece into two pieces, best score first), as
    transformers rebuilds them."""
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    if meta.get("tokenizer.ggml.merges"):
        merges = [(a, b) for a, b in
                  (m.split(" ", 1) for m in meta["tokenizer.ggml.merges"])]
    else:
        scores = [float(x) for x in meta.get("tokenizer.ggml.scores") or
                  [-float(i) for i in range(len(tokens))]]
        merges = _merges_from_scores(tokens, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]
                        ) -> list[tuple[str, str]]:
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for index, (piece, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -len(left), -len(right), index, vocab[left],
                              vocab[right], left, right))
    # best score first; ties: the longer left piece, the longer right one, the piece's
    # place in the file, the halves' ids (transformers' order)
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


def _post_processor(bos: str | None, vocab: Mapping[str, int], byte_level: bool) -> Any:
    """Byte-level offsets (byte-level BPE), plus ``bos`` before every sequence when the file
    asks for it."""
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None:
        steps.append(processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])]))
    return processors.Sequence(steps)


def tokenizer_config(t: GGUFTokenizer, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for ``t``: the fast tokenizer class reads tokenizer.json as is."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": t.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(t, key)
        if value is not None:
            cfg[key] = value
    if t.chat_template:
        cfg["chat_template"] = t.chat_template
    return cfg
