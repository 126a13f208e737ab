"""The request bodies of the OpenAI-compatible server (:mod:`kvpool.engine.serving.server`) and
their checks: every field is untrusted, and a bad value is a 400 whose one line names the
field, never a 500 nor a silent acceptance.

Ranges are vLLM's (``vllm.SamplingParams._verify_args`` and its OpenAI protocol):
``temperature`` finite in [0, 2]; ``top_p`` in (0, 1]; ``top_k`` -1 or 0 (off) or
1..vocabulary size; ``seed`` a signed 64-bit integer; ``max_tokens`` (and chat's
``max_completion_tokens``) >= 1; ``n`` 1 (this server makes one choice); ``stop`` non-empty
strings (at most :data:`MAX_STOP`); ``stop_token_ids`` token ids of the vocabulary;
``presence_penalty``/``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0,
``min_p`` in [0, 1], ``min_tokens`` >= 0, ``logprobs`` >= 0, ``top_logprobs`` 0..20.

Fields vLLM accepts whose effect this engine does not implement (penalties, ``min_p``,
``min_tokens``, ``logit_bias``, ``best_of`` > 1, ``logprobs``, ``echo``, ``suffix``) are
refused with a 400 naming them when they ask for something (a value other than the
neutral one), rather than ignored: the answer would not be what was asked. Unknown fields
are ignored, as OpenAI's are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_TOKENS = 2 ** 31 - 1  # more than any context; larger is a client's mistake
MAX_STOP = 64  # stop strings per request
MAX_STOP_IDS = 1024
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class CommonBody(BaseModel):
    """Fields of both routes."""

    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # the upper bound (the vocabulary) in :func:`check`
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_IDS)
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False  # vLLM extension: token ids next to the text
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted by vLLM, not implemented here: refused unless neutral (:func:`check`)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1)


OpenAIPrompt = str | list[int] | list[str] | list[list[int]]


class CompletionBody(CommonBody):
    prompt: OpenAIPrompt
    logprobs: int | None = Field(None, ge=0)
    echo: StrictBool = False
    suffix: str | None = None


class ChatBody(CommonBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# field -> its neutral value: anything else asks for what this engine does not do
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "min_tokens": 0, "logit_bias": None, "best_of": None,
    "logprobs": None, "echo": False, "suffix": None, "top_logprobs": None,
}
NEUTRAL_TOO: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,),
}


def problem(body: CommonBody, vocab: int) -> str | None:
    """What is wrong with ``body`` beyond its types and ranges (one line naming the
    field; None: nothing). ``vocab``: the model's vocabulary size."""
    if body.n != 1:
        return f"n: only n=1 is supported, got {body.n}"
    if body.top_k > vocab:
        return (f"top_k must be -1 or 0 (off) or 1..{vocab} (the vocabulary), "
                f"got {body.top_k}")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP:
        return f"stop: at most {MAX_STOP} strings, got {len(stops)}"
    if any(not s for s in stops):
        return "stop: stop strings must be non-empty"
    bad = [t for t in body.stop_token_ids or [] if not 0 <= t < vocab]
    if bad:
        return f"stop_token_ids must be token ids in [0, {vocab}), got {str(bad[0])[:24]}"
    for name, neutral in UNSUPPORTED.items():
        value = getattr(body, name, neutral)
        if value != neutral and value not in NEUTRAL_TOO.get(name, ()):
            return f"{name} is not supported by this server (got {str(value)[:40]})"
    return None


# the SamplingParams fields a public request sets (a relayed request carries only these)
PUBLIC_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos")


def public_sampling(params: object, vocab: int) -> dict[str, Any]:
    """Sampling parameters a peer forwards (``/pd/adopt``), as ``SamplingParams``
    keywords: only :data:`PUBLIC_SAMPLING`, each checked as in a public request. Raises
    RequestError (one line naming the field) otherwise — e.g. ``return_logits``."""
    from pydantic import ValidationError

    from kvpool.engine.errors import RequestError

    if not isinstance(params, dict):
        raise RequestError("params must be an object of sampling parameters")
    extra = sorted(str(k)[:40] for k in params if k not in PUBLIC_SAMPLING)
    if extra:
        raise RequestError(f"params: {extra[0]} is not a public sampling parameter "
                           f"(allowed: {', '.join(PUBLIC_SAMPLING)})")
    try:
        body = CommonBody.model_validate(params)
    except ValidationError as e:
        raise RequestError(f"params: {describe(e)}") from None
    why = problem(body, vocab)
    if why is not None:
        raise RequestError(f"params: {why}")
    return {k: params[k] for k in PUBLIC_SAMPLING if k in params}


def describe(e: Any) -> str:
    """A pydantic validation error as one line naming each field."""
    return "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}"
                     for err in e.errors())
