"""The routing key of an OpenAI request body: its prompt, as text or token ids, capped.

The router reads the prompt before any server has checked the body, so :func:`prompt_of`
takes any JSON value, never raises, and does bounded work whatever the body holds: it
keeps at most :data:`MAX_CHARS` characters of text, :data:`MAX_TOKENS` token ids and
:data:`MAX_ITEMS` messages (or content parts), which is more than routing keys (a
prompt's first blocks, :mod:`kvpool.fleet.prefix_key`). What is not a prompt it
understands (a number, nested junk, a list of mixed types) keys as the empty prompt; the
server refuses such a body itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Union

Prompt = Union[str, tuple[int, ...]]

MAX_CHARS = 1 << 16  # characters of text kept (a chat: its messages joined)
MAX_TOKENS = 1 << 14  # token ids kept
MAX_ITEMS = 1 << 12  # messages, or content parts of one message, looked at
MAX_ROLE = 64  # characters of a message's role kept


def prompt_of(body: object) -> Prompt:
    """The prompt of an OpenAI request body, as routing keys it: a completion's
    ``prompt`` (text; token ids; of a batch, its first prompt), or a chat's messages
    joined role by role (``role`` US ``content``, messages separated by RS; a content
    given as parts keeps their ``text``). Anything else keys as the empty prompt."""
    if not isinstance(body, Mapping):
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:MAX_CHARS]
    if isinstance(prompt, list):
        if not prompt:
            return ""
        first = prompt[0]
        if isinstance(first, str):
            return first[:MAX_CHARS]
        if isinstance(first, list):
            return _token_ids(first)
        return _token_ids(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        return _chat(messages)
    return ""


def _token_ids(items: list[Any]) -> Prompt:
    """The first :data:`MAX_TOKENS` items as token ids, if every one of those is an int
    (a bool is not); else the empty prompt."""
    head = items[:MAX_TOKENS]
    if head and all(type(t) is int for t in head):
        return tuple(head)
    return ""


def _chat(messages: list[Any]) -> str:
    parts: list[str] = []
    size = 0
    for m in itertools.islice(messages, MAX_ITEMS):
        if size >= MAX_CHARS:
            break
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        head = f"{role[:MAX_ROLE] if isinstance(role, str) else ''}\x1f"
        part = head + _text(m.get("content"), max(0, MAX_CHARS - size - len(head)))
        parts.append(part)
        size += len(part) + 1
    return "\x1e".join(parts)[:MAX_CHARS]


def _text(content: object, room: int) -> str:
    """A message's content as text, at most ``room`` characters: a string, or the
    ``text`` of its parts (``[{"type": "text", "text": ...}, ...]``); else empty."""
    if isinstance(content, str):
        return content[:room]
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    n = 0
    for p in itertools.islice(content, MAX_ITEMS):
        if n >= room:
            break
        text = p.get("text") if isinstance(p, Mapping) else None
        if isinstance(text, str):
            out.append(text[:room - n])
            n += len(out[-1])
    return "".join(out)
