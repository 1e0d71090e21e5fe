"""The chat server: OpenAI's ``/v1/chat/completions`` in front of a tierkv store.

Routes::

    POST   /v1/chat/completions    a turn; OpenAI request/response shape, ``stream: true`` for SSE
    GET    /v1/models              the one model served
    GET    /v1/models/{id}         that model (OpenAI's retrieve); 404 for another id
    DELETE /v1/sessions/{id}       forget a session of the caller's tenant (its blocks, every tier);
                                   200 with blocks_removed, 0 when nothing was stored under that id
    GET    /healthz                liveness; answers while a turn is generating
    GET    /metrics                Prometheus text: the store's metrics (tierkv.metrics.StoreCollector)

Every GET route answers HEAD too (a load balancer's probe). Replies carry OpenAI's
``system_fingerprint``, a digest of what besides a seed decides them (``fingerprint``). Unseeded
sampling draws from the process's generator, seeded from the OS at startup (torch seeds it with
one constant at import: each restart would repeat the last run's replies).

Who is asking:

* Tenant: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``. The tenant name given to tierkv is
  a hash of the key, never the key: tenant names are data in the store (on disk, in LMDB records),
  keys are secrets. Keys are not checked against a list; each key is simply its own tenant, whose
  blocks no other tenant can hit. No key: the default tenant, shared by every keyless caller.
  Put an authenticating proxy in front of this example before exposing it.
* Session: ``X-Session-ID``, else the body's ``user``. A turn without either is still cached for
  its tenant (a later turn with the same prefix hits it) but no session references it, so it
  can only be evicted, not deleted. One id must name one session wherever it is written: the
  header's bytes are read as UTF-8 (Starlette would read them as latin-1, while the DELETE path is
  percent-decoded UTF-8), and ids with whitespace at either end (which HTTP drops from a header's
  value, not from a path or a JSON string) or control characters are refused (``check_session_id``).

Per request: validate (every refusal is an OpenAI error body with a 4xx status, see ``errors``),
template the messages to ids, take a place in the engine's queue (past ``max_pending_turns`` turns
queued or running: a 429 with ``Retry-After``, spread over a turn, ``errors.RetryAfter``; a stream
takes its place before its response starts, ``AdmittedStream``), then one tierkv turn on the engine (``engine``):
``store.open`` -> ``generate`` -> ``cache.commit``. ``usage.prompt_tokens_details.cached_tokens``
is ``cache.restored_tokens``; ``cached_tokens_by_tier`` is ``cache.restored_from``.

Lifespan: the store, the model and the metrics collector are created at startup and closed at
shutdown (the running turn finishes and commits, the store is flushed). uvicorn waits for the
requests in flight before it shuts the lifespan down, so by default the queued turns run first; a
turn still queued when the engine closes (``Engine.close``) is dropped with a 503, "shutting down"
(its ``Retry-After`` 1 to 2 s, spread: ``errors.shutting_down``).
With ``--timeout-graceful-shutdown`` (uvicorn's flag, or ``python -m examples.server``'s, which it hands
to uvicorn), uvicorn cancels the requests still running when it runs out:
they get the same 503 (a stream: the error event, then its end), and the turn stops at its next
token (``errors.InternalErrors``).
A startup the store or the device refuses (the store in use by another process, say) is logged as
one line, and uvicorn exits with status 3.

``app`` (for ``uvicorn examples.server.app:app``) is made from the environment on first use, not at
import: ``python -m examples.server`` imports this module, and its flags may override a variable
that alone is refused.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import json
import logging
import os
import time
import unicodedata
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

import torch
import transformers
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from lmdb import Error as LmdbError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tierkv
from tierkv import TieredStore
from tierkv.metrics import StoreCollector

from . import errors, schemas
from .engine import Admission, Engine, QueueFull, ServerClosing, Turn, TurnCancelled, TurnResult, build_model
from .errors import ApiError
from .settings import Settings
from .tokenizer import END

logger = logging.getLogger("examples.server")
# What the store, its directory or the device refuse at startup: a setting to fix, said in one line.
# Anything else (a bug) keeps its traceback.
REFUSALS = (ValueError, OSError, LmdbError)


def fingerprint(settings: Settings, device: torch.device) -> str:
    """OpenAI's ``system_fingerprint`` for this configuration: another model, weights' seed or shape,
    device kind (a GPU's model, a CPU's vector code), tierkv or torch gives another one, so that a
    client comparing seeded replies across servers can tell when the same seed may no longer give
    the same reply."""
    # Kernels differ with the GPU model and the CPU's vector code, and round otherwise (tierkv keys
    # its stores on both for that): the device's type alone gave an H100 and an A100 one fingerprint.
    kind = (torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available()
            else torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else "")
    config = (tierkv.__version__, torch.__version__, transformers.__version__, settings.model, settings.seed,
              settings.tiny_hidden, settings.tiny_layers, device.type, kind)
    return "fp_" + hashlib.sha256(repr(config).encode()).hexdigest()[:10]


@dataclass(slots=True)
class ServerState:
    """What the lifespan creates and closes."""

    settings: Settings
    store: TieredStore
    engine: Engine
    registry: CollectorRegistry
    collector: StoreCollector
    fingerprint: str  # OpenAI's system_fingerprint: what, besides a seed, decides the replies

    @classmethod
    def start(cls, settings: Settings) -> "ServerState":
        store = TieredStore(settings.store, device=settings.device, device_budget=settings.device_budget,
                            host_budget=settings.host_budget, disk_budget=settings.disk_budget,
                            block_size=settings.block_size)
        try:
            model, tokenizer = build_model(settings)
            model.to(store.device)
            collector = StoreCollector(store)
            registry = CollectorRegistry()
            registry.register(collector)
        except BaseException:
            store.close()
            raise
        # torch seeds its generator with one constant at import: unseeded requests would draw the same
        # replies again after each restart. Seeded ones set their own state (engine._seeded).
        torch.seed()
        logger.info("serving %s (%s) on %s; store %s", settings.model_name, settings.model, store.device,
                    settings.store or "without a disk tier")
        return cls(settings, store, Engine(model, tokenizer, store, settings.max_pending_turns), registry, collector,
                   fingerprint(settings, store.device))

    def close(self) -> None:
        self.engine.close()  # first: the turn still running commits into the open store
        self.collector.close()
        self.store.close()


class OneLineRefusals:
    """Starlette reports a failed startup to uvicorn as a traceback, which uvicorn logs. For a startup
    ``REFUSALS`` stopped, the lifespan leaves the one line to log in ``app.state.refusal`` and this
    middleware sends it instead; uvicorn still exits with its startup failure status (3)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_refusal(message: Message) -> None:
            refusal = getattr(scope["app"].state, "refusal", None)
            if message["type"] == "lifespan.startup.failed" and refusal is not None:
                message = {**message, "message": refusal}
            await send(message)

        await self.app(scope, receive, send_refusal)


class _AnyPath(PathConvertor):
    """Starlette's ``path`` convertor, newlines included (its ``.*`` stops at one): a DELETE of an id
    with a newline gets the 400 that says what is wrong with it, not a 404."""

    regex = r"[\s\S]*"


register_url_convertor("anypath", _AnyPath())


def log_where_uvicorn_logs() -> None:
    """This example's log lines (the startup's "serving ... on <device>; store ...", a request the
    shutdown cancelled) go where uvicorn's own go, at uvicorn's level, unless whoever runs the app
    configured logging (the root logger has a handler) or this logger. uvicorn configures its own
    loggers only, so they were dropped: Python's last resort shows warnings and above, bare. Called
    at startup, once uvicorn has configured its loggers (``python -m examples.server`` makes the app
    before it runs uvicorn)."""
    source = logging.getLogger("uvicorn")
    if logger.handlers or logging.getLogger().handlers or not source.handlers:
        return
    for handler in source.handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.getLogger("uvicorn.error").getEffectiveLevel())  # where --log-level is set
    logger.propagate = False  # a root handler added later would log each line twice


def one_header(request: Request, name: str, status: int = 400, code: str = "invalid_value") -> bytes | None:
    """The raw value of header ``name`` (lower case), None without it, or the error for a request that
    sends it twice: Starlette's ``headers.get`` takes the first, a proxy may join them ("a, b") or
    keep the last, so one request could name two sessions (or tenants) depending on the way it came."""
    values = [value for key, value in request.scope["headers"] if key == name.encode()]
    if len(values) > 1:
        raise ApiError(status, f"the request has {len(values)} {name} headers; send one", code=code)
    return values[0] if values else None


def tenant_of(request: Request) -> str | None:
    """The tenant of the request's API key: a hash of it, or None without a key."""
    for name in ("authorization", "x-api-key"):
        one_header(request, name, 401, "invalid_api_key")
    auth = request.headers.get("authorization")
    if auth is not None:
        scheme, _, key = auth.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "the Authorization header must be 'Bearer <api key>'", code="invalid_api_key")
    else:
        key = request.headers.get("x-api-key", "").strip()
    return tenant_name(key) if key else None


def tenant_name(api_key: str) -> str:
    """The tenant name tierkv stores for ``api_key``: a digest, since names are data on disk."""
    # Domain-separated, so the name cannot be matched against key digests other systems keep.
    return "key-sha256:" + hashlib.sha256(b"tierkv tenant\0" + api_key.encode("utf-8")).hexdigest()


def check_session_id(value: str, where: str, param: str | None = None) -> str:
    """``value``, a session id given in ``where``, or the 400 that says what to send instead.

    Refused: whitespace at either end, which HTTP's parsers drop from a header's value but not from
    the DELETE path or a JSON string (so " chat 1 " would name one session in the body and another
    in the header), and control characters, which a header cannot carry (but for a tab) and a log
    line does not show.
    """
    if value != value.strip():
        raise ApiError(400, f"the session id in {where} begins or ends with whitespace; send it without "
                       "(ids are compared exactly, and HTTP drops the spaces around a header's value)",
                       param=param, code="invalid_value")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ApiError(400, f"the session id in {where} contains a control character (a tab, a newline...); "
                       "send an id of printable text", param=param, code="invalid_value")
    return value


def session_of(request: Request, user: str | None) -> str | None:
    """The request's session: ``X-Session-ID`` (its bytes read as UTF-8), else the body's ``user``."""
    # Starlette decodes header values as latin-1: "café" sent as UTF-8 would become "cafÃ©", and a
    # DELETE of /v1/sessions/caf%C3%A9 (percent-decoded as UTF-8) would not find it.
    raw = one_header(request, "x-session-id")
    if raw:
        try:
            header = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the X-Session-ID header is not UTF-8 text; send the id encoded as UTF-8",
                           code="invalid_value") from None
        return check_session_id(header, "the X-Session-ID header")
    return check_session_id(user, "user", param="user") if user else None


def path_session_id(request: Request, value: str) -> str:
    """The session id of ``DELETE /v1/sessions/{id}``, checked as ``check_session_id`` checks the others."""
    raw = request.scope.get("raw_path")
    if raw is not None:
        # The server percent-decodes the path as UTF-8 but replaces what is not UTF-8 with U+FFFD,
        # so %FF and %FE would both name the session "\ufffd".
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the session id in the path is not percent-encoded UTF-8; percent-encode the "
                           "id's UTF-8 bytes", code="invalid_value") from None
    if not value:
        raise ApiError(400, "the path names no session; DELETE /v1/sessions/{id}", code="invalid_value")
    return check_session_id(value, "the path")


async def client_left(request: Request) -> None:
    """Returns once the client has disconnected; call it only after the body was read in full."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (a declared length is refused
    before reading anything). A client that leaves before sending all of it raises Starlette's
    ``ClientDisconnect``, which ``errors.install`` answers quietly: there is nobody to answer."""
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def refuse_encoding(request: Request, body: bytes) -> None:
    """For a body that is not JSON: the error that says so where the reason is how it was sent, not
    what it says (the JSON parser's own is "expected value at line 1 column 1"): compressed
    (``Content-Encoding``), or not UTF-8 (Latin-1, which Windows PowerShell 5 sends by default, or
    UTF-16). A UTF-8 byte order mark is not a fault: the body is read without it (RFC 8259 allows)."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise ApiError(415, f"the request body is sent with Content-Encoding: {coding}, which this server does not "
                       "decode; send the JSON uncompressed", code="unsupported_content_encoding")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 text (byte {exc.start} is not); send the JSON encoded "
                       "as UTF-8", code="invalid_json") from None


def make_turn(req: schemas.ChatCompletionRequest, engine: Engine, settings: Settings, session: str | None,
              tenant: str | None) -> Turn:
    """The request as a ``Turn``, or the ``ApiError`` that says what is wrong with it."""
    if req.n is not None and req.n > 1:
        raise ApiError(400, "n > 1 is not supported by this server; send n requests instead (with temperature > 0 "
                       "and different seeds for different replies)", param="n", code="unsupported_value")
    refuse_unsupported(req)
    logit_bias = read_logit_bias(req.logit_bias, engine.tokenizer.vocab_size, frozenset(engine.tokenizer.suppress_ids))
    messages: list[tuple[str, str]] = []
    for i, message in enumerate(req.messages):
        refuse_unsupported_message(i, message)
        text = message.text()
        if text is None:
            if message.role != "assistant":
                raise ApiError(400, f"messages[{i}].content is required for a {message.role} message",
                               param=f"messages[{i}].content", code="missing_required_parameter")
            text = ""
        messages.append((message.role, text))
    prompt_tokens = engine.tokenizer.count_chat(messages)
    if prompt_tokens > settings.max_input_tokens:
        raise ApiError(400, f"this conversation is {prompt_tokens} tokens; this server accepts at most "
                       f"{settings.max_input_tokens} prompt tokens. Shorten the messages",
                       param="messages", code="context_length_exceeded")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens or req.max_tokens or settings.default_max_tokens
    if max_tokens > settings.max_output_tokens:
        raise ApiError(400, f"{param} is {max_tokens}; this server generates at most {settings.max_output_tokens} "
                       "tokens per request", param=param, code="invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4 or not all(stop):
        raise ApiError(400, "stop must be a non-empty string or a list of at most 4 non-empty strings",
                       param="stop", code="invalid_value")
    return Turn(ids=engine.tokenizer.encode_chat(messages), session=session, tenant=tenant, max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop,
                frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
                logit_bias=logit_bias)


def refuse_unsupported(req: schemas.ChatCompletionRequest) -> None:
    """The 400 for a field OpenAI defines that this server cannot honour, unless it holds its neutral
    value: ignored, it would change what the client gets without telling it."""
    def refuse(param: str, message: str, code: str = "unsupported_parameter") -> ApiError:
        return ApiError(400, message, param=param, code=code)

    if req.logprobs:
        raise refuse("logprobs", "logprobs are not supported by this server; omit logprobs (or send false)")
    if req.top_logprobs:
        raise refuse("top_logprobs", "logprobs are not supported by this server; omit top_logprobs (or send 0)")
    if req.tools:
        raise refuse("tools", "tools are not supported by this server; send the request without tools")
    if req.functions:
        raise refuse("functions", "functions are not supported by this server; send the request without functions")
    for param, choice in (("tool_choice", req.tool_choice), ("function_call", req.function_call)):
        if choice is not None and choice not in ("none", "auto"):  # without tools, both mean: answer in text
            raise refuse(param, f"{param} asks for a tool call, and this server calls no tools; omit {param} "
                         "(or send \"none\")", code="unsupported_value")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise refuse("response_format", "this server cannot constrain replies to JSON (response_format "
                     f"{json.dumps(req.response_format.get('type'))}); omit response_format (or send "
                     "{\"type\": \"text\"}) and ask for JSON in the messages", code="unsupported_value")
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise refuse("modalities", "this server replies in text only; omit modalities (or send [\"text\"])",
                     code="unsupported_value")
    if req.audio is not None:
        raise refuse("audio", "this server replies in text only; send the request without audio")
    if req.store:
        raise refuse("store", "this server keeps no completions to retrieve later; omit store (or send false)",
                     code="unsupported_value")
    if req.reasoning_effort is not None:
        raise refuse("reasoning_effort", "this server's model does not reason before replying; send the request "
                     "without reasoning_effort")
    if req.verbosity not in (None, "medium"):
        raise refuse("verbosity", "this server cannot change how verbose replies are; omit verbosity (or send "
                     "\"medium\")", code="unsupported_value")
    if req.web_search_options is not None:
        raise refuse("web_search_options", "this server cannot search the web; send the request without "
                     "web_search_options")
    if req.moderation is not None:
        raise refuse("moderation", "this server runs no moderation model on the request or the reply; send the "
                     "request without moderation (and moderate the text yourself, before and after)")
    if req.stream_options is not None and not req.stream:
        # As OpenAI refuses it: its include_usage asks for a usage chunk, and without a stream there is none.
        raise refuse("stream_options", "stream_options is only allowed with \"stream\": true; send stream: true, "
                     "or omit stream_options (a reply that is not streamed always holds its usage)",
                     code="invalid_value")


def refuse_unsupported_message(i: int, message: schemas.Message) -> None:
    """The 400 for a field OpenAI defines on ``messages[i]`` that this server's chat template has no
    place for (``tokenizer``: role and text only), unless it holds its neutral value: left out of
    the prompt, it would change what the model reads without telling the client. A content part
    other than text (an image, audio, a file, a refusal) is refused by its type, a text part
    without text as missing it."""
    def refuse(field: str, why: str) -> ApiError:
        return ApiError(400, f"messages[{i}].{field}: {why}", param=f"messages[{i}].{field}",
                        code="unsupported_parameter")

    for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
        where = f"messages[{i}].content[{j}]"
        if part.type == "refusal":
            raise ApiError(400, f"{where}: this server's chat template has no place for a refusal; send its text "
                           "as a text part ({\"type\": \"text\", \"text\": ...}) instead", param=f"{where}.type",
                           code="unsupported_value")
        if part.type != "text":
            kind = json.dumps(part.type) if len(part.type) <= 40 else "(a type too long to repeat)"
            raise ApiError(400, f"{where}: this server's model reads text only, and cannot be shown a content part "
                           f"of type {kind}; send text parts ({{\"type\": \"text\", \"text\": ...}}) or a string "
                           "as content", param=f"{where}.type", code="unsupported_value")
        if part.text is None:
            raise ApiError(400, f"{where}.text is required for a part of type \"text\"", param=f"{where}.text",
                           code="missing_required_parameter")
    if message.name:  # "" names no one: nothing is lost without it
        raise refuse("name", "this server's chat template has no place for a participant's name; omit name, "
                     "and write the name into the content instead (\"Alice: ...\")")
    if message.tool_calls:
        raise refuse("tool_calls", "this server calls no tools, and its chat template cannot show a tool call; "
                     "send the conversation without tool calls and their tool messages (or describe them in the "
                     "content)")
    if message.function_call is not None:
        raise refuse("function_call", "this server calls no functions, and its chat template cannot show a "
                     "function call; send the conversation without it (or describe it in the content)")
    if message.refusal is not None:
        raise refuse("refusal", "this server's chat template has no place for a refusal; send its text as the "
                     "message's content instead")
    if message.audio is not None:
        raise refuse("audio", "this server replies in text only and keeps no audio replies; send the message "
                     "without audio, with its transcript as content")


def read_logit_bias(bias: dict[str, float] | None, vocab_size: int, never: frozenset[int] = frozenset()
                    ) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs, zero biases left out, or the 400 that says what is wrong.

    ``never``: the ids generation never picks (``ByteChatTokenizer.suppress_ids``). A positive bias on
    one is refused: OpenAI's +100 makes its token the reply, and here it could not change a thing. A
    negative one asks for what holds anyway, and is accepted."""
    pairs: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 9 else -1
        # One spelling per id: "65" and "065" were two keys for token 65, their biases summed past +-100.
        if not 0 <= token < vocab_size or key != str(token):
            raise ApiError(400, f"logit_bias: {json.dumps(key)} is not a token id of this server's model; keys "
                           f"are token ids from 0 to {vocab_size - 1}, as strings", param="logit_bias",
                           code="invalid_value")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: the bias of token {token} is {value}; biases are from -100 to 100",
                           param="logit_bias", code="invalid_value")
        if value > 0 and token in never:
            raise ApiError(400, f"logit_bias: token {token} is never generated by this server (replies are printable "
                           f"ASCII, tab and newline, ended by <|end|>, token {END}), so a positive bias on it cannot "
                           "apply; bias those tokens instead, or drop this one", param="logit_bias",
                           code="invalid_value")
        if value:
            pairs.append((token, value))
    return tuple(sorted(pairs))


_event = errors.sse_event


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients (OpenAI's among them) skip it, proxies see traffic
async def _sse(engine: Engine, turn: Turn, cid: str, created: int, model: str, fingerprint: str, include_usage: bool,
               keep_alive: float, admission: Admission) -> AsyncIterator[str]:
    """OpenAI's stream: a role chunk, content chunks, a finish chunk, [a usage chunk], ``[DONE]``;
    between them, a ``KEEP_ALIVE`` comment after each ``keep_alive`` seconds with nothing to send,
    so that a proxy's idle timeout does not cut a turn that waits in the queue."""
    def chunk(delta: dict[str, Any] | None, finish: str | None = None, result: TurnResult | None = None) -> str:
        return _event(schemas.chunk(cid, created, model, fingerprint, delta, finish, include_usage, result))

    yield chunk({"role": "assistant", "content": "", "refusal": None})  # as OpenAI's first delta
    result: TurnResult | None = None
    try:
        # aclosing: if this stream is abandoned, the engine's stream is closed too, which stops the turn.
        async with contextlib.aclosing(engine.stream(turn, keep_alive, admission)) as items:
            async for item in items:
                if item is None:
                    yield KEEP_ALIVE
                elif isinstance(item, str):
                    yield chunk({"content": item})
                else:
                    result = item
    except ServerClosing:
        # Dropped from the queue by the shutdown: said as an error event, not a stream cut short.
        yield _event(errors.shutting_down().body())
        return
    except TurnCancelled:
        return
    except Exception:  # noqa: BLE001 - the status line is sent: the error can only be an event now
        logger.exception("internal error in a streamed turn")
        yield _event(ApiError(500, "internal server error", type="server_error").body())
        return
    assert result is not None
    yield chunk({}, result.finish_reason)
    if include_usage:
        yield chunk(None, result=result)
    yield "data: [DONE]\n\n"


class AdmittedStream(StreamingResponse):
    """A stream whose turn was counted in ``pending`` before its response started (``Engine.admit``):
    its turn gives the count back as it leaves the worker (``Engine.stream``), but one that never
    started (the client left before the response began) or was left suspended (a send failed) runs
    no turn or ``finally`` of its own."""

    def __init__(self, content: AsyncIterator[str], admission: Admission, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # a suspended stream drops its turn (queued) or stops it
            finally:
                self._admission.release()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app for ``settings`` (default: ``Settings.from_env()``); the model and store open at startup."""
    settings = Settings.from_env() if settings is None else settings
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, errors.RedactSessionIds) for f in access.filters):
        access.addFilter(errors.RedactSessionIds())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_where_uvicorn_logs()
        try:
            app.state.server = await asyncio.to_thread(ServerState.start, settings)
        except REFUSALS as exc:
            logger.debug("startup refused", exc_info=True)  # the traceback, for whoever enables DEBUG
            app.state.refusal = f"the server cannot start: {exc}"
            raise
        try:
            yield
        finally:
            await asyncio.to_thread(app.state.server.close)

    app = FastAPI(title="tierkv chat server", version=tierkv.__version__, lifespan=lifespan)
    errors.install(app, schemas.FIELDS)
    app.add_middleware(OneLineRefusals)

    @app.exception_handler(ServerClosing)
    async def server_closing(request: Request, exc: ServerClosing) -> JSONResponse:
        # A request that reaches the engine once it closed (a DELETE's call, say): not a bug, not a 500.
        return errors.shutting_down().response()

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        # Refused before anything was queued or stored: the client may simply retry.
        headers = errors.RETRY.headers(state(request).engine.retry_after())
        return ApiError(429, f"this server is busy: {exc}; retry after {headers['Retry-After']} s",
                        type="rate_limit_error", code="rate_limit_exceeded", headers=headers).response()

    def state(request: Request) -> ServerState:
        return request.app.state.server

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server = state(request)
        tenant = tenant_of(request)
        # Parsed here rather than by a FastAPI body parameter, so the size limit applies before
        # the body is read in full and JSON errors come out in OpenAI's shape.
        body = await read_body(request, settings.max_body_bytes)
        try:
            req = schemas.ChatCompletionRequest.model_validate_json(body.removeprefix(codecs.BOM_UTF8))
        except ValidationError as exc:
            found = exc.errors(include_url=False)
            if found[0]["type"] == "json_invalid":
                refuse_encoding(request, body)
            raise errors.from_validation(found, schemas.FIELDS) from None
        session = session_of(request, req.user)
        turn = make_turn(req, server.engine, settings, session, tenant)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model or settings.model_name
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # Counted here, not when the stream starts: the status line must say 429, and requests that
            # came in between would not have seen the count.
            admission = server.engine.admit()
            return AdmittedStream(_sse(server.engine, turn, cid, created, model, server.fingerprint, include_usage,
                                       settings.sse_keep_alive, admission), admission,
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            # The turn is cancelled if the client leaves: dropped if still queued, else stopped at its next token.
            result = await server.engine.complete(turn, until=lambda: client_left(request))
        except ServerClosing:
            raise errors.shutting_down() from None
        except TurnCancelled:
            raise ClientDisconnect() from None  # answered quietly, see errors.install
        return JSONResponse(schemas.completion(cid, created, model, server.fingerprint, result))

    served = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "tierkv"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    # OpenAI's retrieve; ids may hold "/" ("org/model")
    @app.api_route("/v1/models/{model:anypath}", methods=["GET", "HEAD"])
    async def model(model: str) -> dict[str, Any]:
        if model != settings.model_name:
            raise ApiError(404, f"this server serves one model, {json.dumps(settings.model_name)}; GET "
                           "/v1/models lists it", param="model", code="model_not_found")
        return served

    @app.delete("/v1/sessions/{session_id:anypath}")  # ids are data: "team/alice" is one session
    async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
        server = state(request)
        tenant = tenant_of(request)
        session_id = path_session_id(request, session_id)
        # On the engine's thread: the forget comes after this session's turns already queued, which
        # would otherwise commit the session back right after it was forgotten.
        removed = await server.engine.call(server.store.forget, session=session_id, tenant=tenant)
        return {"id": session_id, "object": "session.deleted", "deleted": True, "blocks_removed": removed}

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz(request: Request) -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name, "pending_turns": state(request).engine.pending}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request) -> Response:
        # Off the event loop: a scrape reads store.stats(), which waits for the store's lock.
        text = await asyncio.to_thread(generate_latest, state(request).registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


def __getattr__(name: str) -> Any:
    """``app``, for ``uvicorn examples.server.app:app``: configured by ``TIERKV_*`` variables, made once.

    Where it listens is the server's to say (uvicorn's ``--host``/``--port``, or ``UVICORN_HOST``/
    ``UVICORN_PORT``): ``TIERKV_HOST`` and ``TIERKV_PORT`` are read by ``python -m examples.server``
    alone, so a warning says so when they are set; so is ``TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN`` (uvicorn's
    ``--timeout-graceful-shutdown``). Nor can the app check that address before its
    startup: uvicorn binds it only after the lifespan's startup has run (the store opened, the tiny
    model built: 0.08 s, against the seconds uvicorn's import of this module takes, torch's), and
    tells the app nothing of it (the lifespan's scope holds no address). ``python -m
    examples.server`` checks it first (``settings.check_listen``)."""
    if name == "app":
        ignored = [env for env in ("TIERKV_HOST", "TIERKV_PORT") if env in os.environ]
        if ignored:
            logger.warning("%s set, but only `python -m examples.server` reads %s: a server importing "
                           "examples.server.app:app listens where its own flags say (uvicorn: --host, --port)",
                           " and ".join(ignored), "them" if len(ignored) > 1 else "it")
        if "TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN" in os.environ:
            logger.warning("TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN set, but only `python -m examples.server` reads it: "
                           "a server importing examples.server.app:app shuts down as its own flags say (uvicorn: "
                           "--timeout-graceful-shutdown)")
        app = globals()["app"] = create_app()  # later lookups find it without calling here
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
