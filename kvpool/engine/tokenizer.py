"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus the chat format.

Chat format (documented choice): every model gets ChatML, whatever its
tokenizer_config.json ``chat_template`` says (running Jinja templates is out of scope)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n ...  <|im_start|>assistant\\n

The server adds ``<|im_end|>`` to a chat request's stop tokens when the vocabulary has it as
a single token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvpool.engine.errors import CheckpointError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token: str | None = None) -> None:
        self.tok = tok
        self.eos_token_ids: set[int] = set()
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            self.eos_token_ids.add(i)
        self.im_end_id = tok.token_to_id(IM_END)

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
        eos = None
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            try:
                eos = _token_str(json.loads(cfg.read_text()).get("eos_token"))
            except json.JSONDecodeError:
                pass
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """ChatML text for ``[{"role": ..., "content": str | [{"type": "text", ...}]}]``
        ending with an open assistant turn."""
        parts = [f"{IM_START}{m['role']}\n{content_text(m.get('content'))}{IM_END}\n"
                 for m in messages]
        return "".join(parts) + f"{IM_START}assistant\n"

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


def content_text(content: Any) -> str:
    """OpenAI message content as plain text (string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _token_str(t: Any) -> str | None:
    if isinstance(t, dict):  # older tokenizer_config.json: {"content": "</s>", ...}
        return t.get("content")
    return t if isinstance(t, str) else None
