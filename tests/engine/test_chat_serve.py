"""`kvpool serve` formats chats with the checkpoint's own template: a tiny generated model
with a SmolLM2-style template (a default system turn, a raise_exception) as a subprocess
driven by the OpenAI client. Greedy chat answers equal transformers' generate on the prompt
its apply_chat_template renders; hostile messages get a 400 with one line, never a 500."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from .helpers import load_hf
from .served import serving

openai = pytest.importorskip("openai")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download

NAME = "tiny-chat"
SYSTEM_DEFAULT = "You are a small test model."
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'forbidden' %}{{ raise_exception('role forbidden is not "
    "allowed here') }}{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    + SYSTEM_DEFAULT + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def hf_greedy(model, hf_tok, messages: list[dict], max_new: int) -> tuple[list[int], str]:
    """transformers: the template's prompt and its greedy continuation (stopping on the
    generation config's eos), decoded without special tokens; a trailing incomplete UTF-8
    sequence (U+FFFD) is dropped, as the engine's detokenizer holds it back."""
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    new = gen[0, len(ids):].tolist()
    return ids, hf_tok.decode(new, skip_special_tokens=True).rstrip("\ufffd")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    """The session's tiny Llama, copied, with a chat_template.jinja; its generation config
    names both <|endoftext|> and <|im_end|> as eos, as chat checkpoints do (so transformers'
    generate stops where a chat does)."""
    from kvpool.engine.model.tiny import EOS, IM_END

    d = tmp_path_factory.mktemp("chat") / NAME
    shutil.copytree(tiny_dir, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    vocab = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[EOS], "eos_token_id": [ids[EOS], ids[IM_END]]}))
    return d


@pytest.fixture(scope="module")
def server(chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("chat-serve") / "serve.log"
    with serving(chat_dir, log, "--served-model-name", NAME, "--num-kv-blocks", "256",
                 "--block-size", "8", "--max-model-len", "160") as base:
        yield base
    assert "no chat template" not in log.read_text()  # it has one


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(chat_dir: Path):
    from transformers import AutoTokenizer

    return load_hf(chat_dir), AutoTokenizer.from_pretrained(chat_dir)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Tell me about the cat."}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And a number?"}],
]


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_greedy_chat_equals_transformers(client, reference, i):
    model, hf_tok = reference
    ids, want = hf_greedy(model, hf_tok, CHATS[i], 32)
    r = client.chat.completions.create(model=NAME, messages=CHATS[i], max_tokens=32,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(ids)  # the template's prompt, not plain ChatML
    assert r.choices[0].message.content == want
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 32


def test_default_system_turn_is_in_the_prompt(client, reference, chat_dir):
    """The template adds a system turn when the request has none: the prompt is longer
    than the plain ChatML of the same message (what the server sent before)."""
    from kvpool.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(chat_dir)
    msgs = CHATS[0]
    plain = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                       "<|im_start|>assistant\n", add_special_tokens=False)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode_chat(msgs)) > len(plain)


def test_streaming_chat_equals_non_streaming(client):
    kw = dict(model=NAME, messages=CHATS[1], max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_still_take_raw_text(client):
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8


def test_chat_stops_on_the_end_of_turn_token(server, chat_dir):
    """<|im_end|> stops a chat even with ignore_eos (it ends the turn), and is not in the
    text; a completion with ignore_eos runs on through it."""
    from kvpool.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(chat_dir)
    (im_end,) = tok.chat_stop_ids
    assert im_end == tok.tok.token_to_id("<|im_end|>")
    ids = tok.encode_chat(CHATS[0])
    comp = httpx.post(f"{server}/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}).json()["choices"][0]
    chat = httpx.post(f"{server}/v1/chat/completions", json={
        "model": NAME, "messages": CHATS[0], "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}).json()
    out = comp["token_ids"]
    if im_end in out:
        assert chat["choices"][0]["finish_reason"] == "stop"
        assert chat["usage"]["completion_tokens"] == out.index(im_end) + 1
    else:
        assert chat["choices"][0]["finish_reason"] == "length"


HOSTILE = [
    ({"messages": "hello"}, "messages"),
    ({"messages": [["user", "hi"]]}, "messages"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 12}]}, "content"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "file:///etc/passwd"}}]}]},
     "text parts"),
    ({"messages": [{"role": "forbidden", "content": "hi"}]}, "role forbidden is not allowed"),
    ({"messages": [{"role": "user", "content": "x" * 200_000}]}, "characters"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "max_model_len"),
]


@pytest.mark.parametrize("body, match", HOSTILE)
def test_hostile_messages_get_400_with_one_line(server, body, match):
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": NAME, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert match in msg and "\n" not in msg and len(msg) < 600, msg


def test_odd_role_and_still_serving(client):
    r = client.chat.completions.create(
        model=NAME, max_tokens=3, messages=[{"role": "narrator 👾", "content": None},
                                            {"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1


def test_fallback_to_chatml_is_logged_once(tiny_dir, caplog):
    """A checkpoint without a template: ChatML, and the server says so at start."""
    from kvpool.engine import Engine
    from kvpool.engine.serving.async_engine import AsyncEngine
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.serving.server import create_app

    engine = Engine(EngineConfig(model=str(tiny_dir), num_kv_blocks=16))
    assert engine.tokenizer is not None and engine.tokenizer.chat_template.is_fallback
    with caplog.at_level("WARNING", logger="kvpool.engine.serving.server"):
        create_app(AsyncEngine(engine))
    lines = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(lines) == 1 and "ChatML" in lines[0]
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generate_chat_applies_the_template(chat_dir):
    """`kvpool generate --chat` equals a chat request rendered by the template."""
    from click.testing import CliRunner

    from kvpool.cli.main import cli
    from kvpool.engine import LLM, SamplingParams

    r = CliRunner().invoke(cli, ["generate", "--chat", str(chat_dir),
                                 "What is the capital of France?", "--max-tokens", "12"])
    assert r.exit_code == 0, r.output
    llm = LLM(str(chat_dir), num_kv_blocks=64)
    tok = llm.tokenizer
    ids = tok.encode_chat(CHATS[0])
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12,
                                              stop_token_ids=list(tok.chat_stop_ids)))[0]
    assert f"-> {want.text!r} ({want.finish_reason})" in r.output
