"""The model's own chat template: rendered prompts equal transformers' apply_chat_template
(SmolLM2's template from the GGUF file, a Llama-3-style and a Qwen-style template), where
templates are found, and hostile messages / templates give one-line errors."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from kvpool.engine.chat_template import (
    CHATML, ChatTemplate, ChatTemplateError, normalize_messages)
from kvpool.engine.errors import CheckpointError
from kvpool.engine.model.real_models import smollm2_gguf
from kvpool.engine.model.tiny import train_tokenizer
from kvpool.engine.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'user' or message.role == 'assistant') %}
        {{- raise_exception('roles must be user or assistant after the system turn') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Gemma-like: no system role, strict alternation enforced with raise_exception
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

SYSTEM = {"role": "system", "content": "You are a pirate. Answer in one line."}
CHATS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system + user": [SYSTEM, {"role": "user", "content": "Hello there!"}],
    "multi-turn, system": [
        SYSTEM, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "  Blue, matey.  "},
        {"role": "user", "content": "And a number? <b>\"quoted\"</b> and ünïcödé"}],
    "multi-turn, no system": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How many days are in a week?\n\nThink first."}],
}


@functools.cache
def _smollm2_template() -> tuple[str | None, str]:
    """SmolLM2's template from its GGUF metadata, or None and why it is unavailable."""
    located = smollm2_gguf()
    if located.path is None:
        return None, located.reason
    import gguf

    field = gguf.GGUFReader(located.path).fields["tokenizer.chat_template"]
    return str(field.contents()), located.reason


def smollm2_template() -> str:
    pytest.importorskip("gguf")
    source, reason = _smollm2_template()
    if source is None:
        pytest.skip(f"real model SmolLM2 unavailable: {reason}")
    return source


@pytest.fixture(scope="module")
def base_tokenizer():
    return train_tokenizer(512)


def hf_tokenizer(tok, template: str, special: dict[str, str]):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                                **special)


TEMPLATES = {
    "smollm2": (smollm2_template, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}),
    "llama3": (lambda: LLAMA3, {"bos_token": "<|begin_of_text|>",
                                "eos_token": "<|eot_id|>"}),
    "qwen": (lambda: QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma": (lambda: GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>"}),
}


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendered_prompt_equals_transformers(name, chat, base_tokenizer):
    source_fn, special = TEMPLATES[name]
    source = source_fn()
    messages = CHATS[chat]
    if name == "gemma" and messages[0]["role"] == "system":
        pytest.skip("Gemma's template has no system role")
    hf = hf_tokenizer(base_tokenizer, source, special)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate(source, special).render(messages)
    assert got == want
    assert got.endswith(("assistant\n", "assistant<|end_header_id|>\n\n", "model\n"))
    # and without the generation prompt
    assert ChatTemplate(source, special).render(messages, add_generation_prompt=False) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def test_smollm2_adds_its_default_system_turn():
    got = ChatTemplate(smollm2_template()).render(CHATS["one user turn"])
    assert got.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_template_exception_equals_transformers_and_is_one_line(base_tokenizer):
    jinja2 = pytest.importorskip("jinja2")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    hf = hf_tokenizer(base_tokenizer, GEMMA, {"bos_token": "<bos>"})
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        hf.apply_chat_template(bad, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="alternate") as e:
        ChatTemplate(GEMMA).render(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        ChatTemplate(LLAMA3).render([{"role": "tool", "content": "x"}])


def test_tojson_and_strftime_now_as_transformers(base_tokenizer):
    source = ("{{ messages[0] | tojson }}|{{ messages | tojson(indent=2) }}|"
              "{{ strftime_now('%Y') }}")
    msgs = [{"role": "user", "content": "<tag> & \"ü\""}]
    hf = hf_tokenizer(base_tokenizer, source, {})
    assert ChatTemplate(source).render(msgs) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_generation_tag_and_loop_controls_render():
    source = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
              "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert ChatTemplate(source).render([SYSTEM, {"role": "user", "content": "x"}]) == "[x]"


def test_chatml_fallback_is_the_old_format():
    msgs = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]
    assert ChatTemplate(CHATML).render(msgs) == (
        f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")


# -- where the template comes from ------------------------------------------------------

def write_dir(path: Path, base_tokenizer, config: dict, jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base_tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def test_template_sources(tmp_path, base_tokenizer):
    eos = {"eos_token": "<|im_end|>"}
    d = write_dir(tmp_path / "str", base_tokenizer, {**eos, "chat_template": QWEN})
    assert ChatTemplate.from_dir(d, json.loads((d / "tokenizer_config.json").read_text())
                                 ).source == QWEN
    d = write_dir(tmp_path / "list", base_tokenizer, {**eos, "chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": QWEN}]})
    assert Tokenizer.from_dir(d).chat_template.source == QWEN
    d = write_dir(tmp_path / "jinja-wins", base_tokenizer, {**eos, "chat_template": QWEN},
                  jinja=GEMMA)
    assert Tokenizer.from_dir(d).chat_template.source == GEMMA
    d = write_dir(tmp_path / "none", base_tokenizer, eos)
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template.is_fallback and tok.chat_template.source == CHATML
    assert not Tokenizer.from_dir(tmp_path / "jinja-wins").chat_template.is_fallback


@pytest.mark.parametrize("config, jinja, match", [
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, None, "none named 'default'"),
    ({"chat_template": 3}, None, "must be a string"),
    ({"chat_template": "{% for m in messages %}"}, None, "bad Jinja template"),
    ({}, "{{ unclosed ", "chat_template.jinja: bad Jinja template"),
])
def test_bad_template_in_checkpoint_is_one_clear_line(tmp_path, base_tokenizer, config,
                                                      jinja, match):
    d = write_dir(tmp_path / "bad", base_tokenizer, config, jinja)
    with pytest.raises(CheckpointError, match=match) as e:
        Tokenizer.from_dir(d)
    assert "\n" not in str(e.value)


def test_tokenizer_chat_ids_and_stop_ids_as_transformers(tmp_path, base_tokenizer):
    d = write_dir(tmp_path / "qwen", base_tokenizer,
                  {"eos_token": "<|endoftext|>", "chat_template": QWEN})
    tok = Tokenizer.from_dir(d)
    assert tok.chat_stop_ids == (base_tokenizer.token_to_id("<|im_end|>"),)
    msgs = CHATS["multi-turn, system"]
    hf = hf_tokenizer(base_tokenizer, QWEN, {"eos_token": "<|endoftext|>"})
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode_chat(msgs) == hf(text, add_special_tokens=False)["input_ids"]
    # Llama-3's end-of-turn is not in this vocabulary: no stop id, no error
    d = write_dir(tmp_path / "llama3", base_tokenizer, {"chat_template": LLAMA3})
    assert ChatTemplate(LLAMA3).stop_tokens == ("<|eot_id|>",)
    assert Tokenizer.from_dir(d).chat_stop_ids == ()
    assert ChatTemplate(GEMMA).stop_tokens == ("<end_of_turn>",)


# -- untrusted messages and templates ----------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\].role"),
    ([{"role": 7, "content": "hi"}], r"messages\[0\].role"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be"),
    ([{"role": "user", "content": {"text": "hi"}}], "content must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "only text parts"),
])
def test_malformed_messages_are_refused(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(CHATML).render(messages)


def test_odd_roles_and_extra_keys_reach_the_template():
    msgs = [{"role": "👾 weird\nrole", "content": None, "name": "x", "tool_calls": [1]}]
    out = normalize_messages(msgs)
    assert out == [{"role": "👾 weird\nrole", "content": "", "name": "x", "tool_calls": [1]}]
    assert out[0] is not msgs[0]
    assert ChatTemplate(CHATML).render(msgs).startswith("<|im_start|>👾 weird\nrole\n")


def test_message_text_beyond_the_limit_is_refused_before_rendering():
    big = [{"role": "user", "content": "x" * 1000}, {"role": "user", "content": "y" * 1000}]
    assert ChatTemplate(CHATML).render(big, max_chars=3000)
    with pytest.raises(ChatTemplateError, match="more than 1500 characters"):
        ChatTemplate(CHATML).render(big, max_chars=1500)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% include '/etc/passwd' %}",
    "{% import '/etc/passwd' as p %}",
    "{% extends '/etc/passwd' %}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages[0].pop('role') }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 1 / 0 }}",
    "{{ messages[5]['content'] + 'x' }}",
    "{{ messages[0]['content'] + 1 }}",
])
def test_sandbox_refuses_and_errors_are_one_line(source):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert msg.startswith("chat template: ") and "\n" not in msg and len(msg) < 400
    assert "root:" not in msg  # nothing of /etc/passwd


@pytest.mark.parametrize("source", [
    "{{ messages[0].content.__class__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ namespace.__init__ }}",
    "{{ messages|attr('__class__') }}",
    "{{ '{0.__class__}'.format(messages) }}",
])
def test_unsafe_attribute_is_undefined_and_renders_empty(source):
    assert ChatTemplate(f"[{source}]").render(CHATS["one user turn"]) == "[]"


def test_undefined_names_render_empty_as_in_transformers():
    assert ChatTemplate("[{{ nothing }}]{{ bos_token }}").render(CHATS["one user turn"]) == "[]"
