"""The OpenAI chat-completions wire format: the request as parsed, and the bodies sent back.

Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a number), as OpenAI
does. Every field of OpenAI's chat-completions request is read: the ones that shape the reply are
honoured (``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` included), or, where this
server cannot honour them (``n`` > 1, ``logprobs``, ``tools``, ``response_format`` other than text,
``moderation``...),
refused by name with a 400 unless they hold their neutral value, as are the fields of a message
the chat template has no place for (``name``, an assistant's ``tool_calls``...) and ``stream_options``
without ``stream``; the ones that do not change the reply (``metadata``, ``parallel_tool_calls``,
``prediction``, ``service_tier``, the prompt-cache hints ``prompt_cache_key``, ``prompt_cache_options``
and ``prompt_cache_retention``, ``safety_identifier``) are accepted.
Fields OpenAI does not define are ignored.

Usage reports what tierkv did for the turn::

    "usage": {"prompt_tokens": 120, "completion_tokens": 16, "total_tokens": 136,
              "prompt_tokens_details": {"cached_tokens": 103,     # restored from tierkv, not computed
                                        "audio_tokens": 0,
                                        "cached_tokens_by_tier": {"device": 64, "host": 39, "disk": 0}},
              "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}

The details, a message's ``refusal`` and ``annotations``, and ``service_tier`` are there as OpenAI's
current API always sends them: the types make them optional, but clients read
``usage.completion_tokens_details.reasoning_tokens`` and the like straight off a reply, and fail on
a server that leaves them out. Each holds what is true here: this model neither reasons nor refuses,
reads and writes no audio, uses no prediction (``prediction`` is accepted as the hint it is), cites
nothing, and runs in one tier, ``"default"``, whatever ``service_tier`` the request asked for (as
OpenAI answers "auto" with the tier that served it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .engine import TurnResult
from .settings import MAX_MODEL_CHARS

# allow_inf_nan: NaN and Infinity (which Python's json.dumps writes) are refused as not finite, not
# told "should be less than or equal to 2" (no comparison holds for NaN).
_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(BaseModel):
    """One part of a message's content. Only ``text`` parts are served; any other ``type`` (an image,
    audio, a file, an assistant's refusal) is read here and refused by name (``app.refuse_unsupported_message``):
    a ``Literal["text"]`` told a client sending an image "Input should be 'text'; or Field required"."""

    model_config = _STRICT
    type: str
    text: str | None = None  # required of a text part, checked with the type


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    # Refused unless neutral (see app.refuse_unsupported_message): the chat template has no place for them.
    name: str | None = None
    tool_calls: list[Any] | None = None         # an assistant's
    function_call: dict[str, Any] | None = None  # an assistant's; the deprecated form of tool_calls
    refusal: str | None = None                  # an assistant's
    audio: dict[str, Any] | None = None         # an assistant's: a reference to an earlier audio reply

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = _STRICT
    # Echoed in the reply and in every chunk of a stream: a body's worth of model name came back once
    # per token (a 4 MiB request streamed 2 GiB). OpenAI's ids are far shorter.
    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    temperature: float | None = Field(None, ge=0, le=2)    # OpenAI's default is 1; 0 is greedy
    top_p: float | None = Field(None, ge=0, le=1)          # OpenAI's range; 0: the most likely token only
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's; torch refuses more
    stream: bool | None = False  # OpenAI's is "boolean or null": null is false, as left out
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in -100..100
    # Refused unless neutral (see app.make_turn): this server cannot honour them.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None          # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Asks for the input and the reply to be moderated: ignored, unmoderated text would reach a client
    # that relies on it, without a word.
    moderation: dict[str, Any] | None = None
    # Accepted and without effect on the reply: this server has nothing they would change.
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None     # no tools are ever called
    prediction: dict[str, Any] | None = None    # a latency hint; the reply is the same without it
    service_tier: str | None = None
    # Hints to OpenAI's prompt cache; tierkv caches every prompt's blocks in any case, keyed on the
    # tenant and the tokens (the session id, not these, names what a DELETE forgets).
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None  # for OpenAI's abuse detection; nobody here reads it


FIELDS = frozenset(name for model in (ChatCompletionRequest, Message, ContentPart, StreamOptions)
                   for name in model.model_fields)


SERVICE_TIER = "default"  # the one way this server processes a request, whatever service_tier asked for


def usage(result: TurnResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens, "audio_tokens": 0,
                                  "cached_tokens_by_tier": dict(result.cached_by_tier)},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0},
    }


def completion(cid: str, created: int, model: str, fingerprint: str, result: TurnResult) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": fingerprint, "service_tier": SERVICE_TIER,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None,
                                             "annotations": []},
                     "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage(result),
    }


def chunk(cid: str, created: int, model: str, fingerprint: str, delta: dict[str, Any] | None,
          finish_reason: str | None = None, with_usage: bool = False,
          result: TurnResult | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices) that
    ``stream_options.include_usage`` adds last, as OpenAI does (other chunks then carry ``usage: null``)."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": fingerprint, "service_tier": SERVICE_TIER,
                            "choices": [] if delta is None else
                            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        body["usage"] = usage(result) if result is not None else None
    return body
