"""Chat templates: the checkpoint's own Jinja template, rendered the way transformers does.

Where the template comes from (transformers' order): ``chat_template.jinja`` in the model
folder; else ``tokenizer_config.json``'s ``chat_template`` (a string, or the list of
``{"name", "template"}`` of which the one named ``default`` is used). A checkpoint with
neither gets ChatML (:data:`CHATML`); :attr:`ChatTemplate.is_fallback` says so, and the
server logs it once at start.

Rendering follows ``transformers.utils.chat_template_utils``: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the loop-controls
extension and the ``{% generation %}`` tag; ``raise_exception``, ``strftime_now`` and a
``tojson`` filter that does not escape HTML; the variables ``messages``, ``tools``=None,
``documents``=None, ``add_generation_prompt`` and the named special tokens of
``tokenizer_config.json`` (bos/eos/unk/sep/pad/cls/mask, as transformers 5's
``special_tokens_map``).

Untrusted input: a request's messages are checked and normalized first
(:func:`normalize_messages`: a list of objects with a string role; content a string, null,
or a list of text parts joined with newlines as vLLM does); anything raised while rendering
(``raise_exception``, a type error, a sandbox refusal, a runaway recursion) becomes one
:class:`ChatTemplateError` line, which the server answers with 400. The sandbox keeps a
template (it comes from the checkpoint) away from private attributes, from mutating
objects and from the filesystem (the environment has no loader).

Stop tokens: :attr:`ChatTemplate.stop_tokens` are the end-of-turn markers the template text
writes (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...); the tokenizer turns those that
are single tokens into stop ids for chat requests. (The eos ids of tokenizer_config.json,
config.json and generation_config.json stop every request unless it sets ``ignore_eos``;
the engine owns those.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpool.engine.errors import CheckpointError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

# end-of-turn markers of the common template families (ChatML, Llama 3, Gemma, Phi-3,
# Command-R, Mistral/Llama 2): a chat stops on those its template writes
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
               "<|END_OF_TURN_TOKEN|>", "</s>")

_MAX_ERROR = 300  # characters of an error message kept in the one-line answer


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: they are malformed, or the template refused them
    (its ``raise_exception``) or failed on them. The message is one line."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                      ).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def one_line(e: BaseException) -> str:
    """``e`` as one short line: its type when it has no message."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR - 3] + "..."


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 is_fallback: bool = False) -> None:
        """Compile ``source``; a syntax error raises :class:`jinja2.TemplateSyntaxError`."""
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.is_fallback = is_fallback
        self._template = _environment().from_string(source)
        self.stop_tokens: tuple[str, ...] = tuple(t for t in END_OF_TURN if t in source)

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer_config: Mapping[str, Any] | None = None
                 ) -> ChatTemplate:
        """The template of the model folder ``path`` (``tokenizer_config`` is its parsed
        tokenizer_config.json, if any); ChatML when it has none. An unreadable or
        ill-formed template raises :class:`CheckpointError` naming the file."""
        cfg = tokenizer_config or {}
        special = special_tokens(cfg)
        jinja_file = Path(path) / "chat_template.jinja"
        source: str | None
        if jinja_file.is_file():
            where, source = str(jinja_file), _read(jinja_file)
        else:
            where = f"{Path(path) / 'tokenizer_config.json'} chat_template"
            source = _pick(cfg.get("chat_template"))
        if source is None:
            return cls(CHATML, special, is_fallback=True)
        try:
            return cls(source, special)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"{where}: bad Jinja template: {one_line(e)} "
                                  f"(line {e.lineno})") from None

    def render(self, messages: Any, add_generation_prompt: bool = True,
               max_chars: int | None = None) -> str:
        """The prompt text for ``messages`` (untrusted: a request's JSON); with
        ``add_generation_prompt`` it ends with an open assistant turn. Raises
        :class:`ChatTemplateError` for malformed messages, more than ``max_chars``
        characters of message text, or a template that raises or fails on them."""
        msgs = normalize_messages(messages, max_chars)
        try:
            return self._template.render(
                messages=msgs, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except Exception as e:  # template errors, TypeError, SecurityError, RecursionError
            raise ChatTemplateError(f"chat template: {one_line(e)}") from None


def normalize_messages(messages: Any, max_chars: int | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages as the template gets them: each a new dict with a string
    ``role`` and a string ``content`` (null is ""; a list of ``{"type": "text", "text"}``
    parts is joined with newlines); other keys (name, tool_calls, ...) kept as they are.
    Raises :class:`ChatTemplateError` naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        content = _content_text(m.get("content"), i)
        total += len(role) + len(content)
        if max_chars is not None and total > max_chars:
            raise ChatTemplateError(f"messages hold more than {max_chars} characters")
        out.append({**m, "role": role, "content": content})
    return out


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a parsed tokenizer_config.json (a token is a string or,
    in older files, ``{"content": ...}``)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        t = tokenizer_config.get(name)
        if isinstance(t, dict):
            t = t.get("content")
        if isinstance(t, str):
            out[name] = t
    return out


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type", "text") == "text"
                    and isinstance(p.get("text"), str)):
                raise ChatTemplateError(f"messages[{i}].content: only text parts "
                                        "({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(p["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")


def _pick(value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates
    (the ``default`` one; transformers refuses a list without one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):  # a mapping name -> template
        value = [{"name": k, "template": v} for k, v in value.items()]
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise CheckpointError(f"tokenizer_config.json has chat templates "
                              f"{sorted(str(n) for n in named)} but none named 'default'")
    raise CheckpointError("tokenizer_config.json: chat_template must be a string or a list "
                          "of {name, template}")


def _read(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {f}: {one_line(e)}") from None
