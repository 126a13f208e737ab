"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus the model's chat
template (:mod:`kvpool.engine.chat_template`: the checkpoint's Jinja template, ChatML for a
checkpoint without one).

A chat prompt is rendered to text and encoded without added special tokens (the template
writes them), as transformers' ``apply_chat_template`` does; :attr:`Tokenizer.chat_stop_ids`
are the template's end-of-turn tokens that a chat request also stops on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvpool.engine.chat_template import CHATML, ChatTemplate, special_tokens
from kvpool.engine.errors import CheckpointError

# text beyond this many characters per context token is refused before it is tokenized
# (no real tokenizer packs that many characters into one token; tokenizing costs time and
# memory in proportion to the text, so the bound comes first)
MAX_CHARS_PER_TOKEN = 64


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token: str | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        """``chat_template`` defaults to ChatML (as for a checkpoint without a template)."""
        self.tok = tok
        self.eos_token_ids: set[int] = set()
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            self.eos_token_ids.add(i)
        self.chat_template = chat_template or ChatTemplate(CHATML, is_fallback=True)
        self.chat_stop_ids: tuple[int, ...] = tuple(
            i for t in self.chat_template.stop_tokens if (i := tok.token_to_id(t)) is not None)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """None when the folder has no tokenizer.json (the engine then takes token ids only)."""
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise CheckpointError(f"cannot load {f}: {e}") from None
        config: dict[str, Any] = {}
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            try:
                loaded = json.loads(cfg.read_text())
            except json.JSONDecodeError:
                loaded = None
            config = loaded if isinstance(loaded, dict) else {}
        return cls(tok, special_tokens(config).get("eos_token"),
                   ChatTemplate.from_dir(path, config))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Releases the GIL while it works (``encode_batch`` does,
        ``encode`` does not), so a long text encoded on a thread does not stall the
        server's event loop; callers bound the text first (:data:`MAX_CHARS_PER_TOKEN`)."""
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Any, max_chars: int | None = None) -> str:
        """The chat template's text for ``[{"role": ..., "content": str | [text parts]}]``
        (untrusted), ending with an open assistant turn; raises
        :class:`~kvpool.engine.chat_template.ChatTemplateError` (one line)."""
        return self.chat_template.render(messages, add_generation_prompt=True,
                                         max_chars=max_chars)

    def encode_chat(self, messages: Any, max_chars: int | None = None) -> list[int]:
        """Token ids of :meth:`apply_chat_template`'s text (no special tokens added: the
        template writes them)."""
        return self.encode(self.apply_chat_template(messages, max_chars),
                           add_special_tokens=False)

    def detokenize_step(self, ids: list[int], offsets: tuple[int, int]
                        ) -> tuple[str, tuple[int, int]]:
        """Incremental decoding: new text since ``offsets`` = (prefix, read) and the new
        offsets. Decoding a few tokens of left context keeps spacing right; a trailing
        U+FFFD (incomplete UTF-8 sequence) is held back until the next token completes it."""
        prefix, read = offsets
        before = self.decode(ids[prefix:read])
        after = self.decode(ids[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            return after[len(before):], (read, len(ids))
        return "", offsets

