"""OpenAI-style errors: every refusal is ``{"error": {"message", "type", "param", "code"}}``.

``ApiError`` is raised by the routes; ``install(app)`` renders it, and also turns FastAPI's and
Starlette's own refusals (validation, unknown route, wrong method, a body over the size limit) into
the same shape, so a client never gets a bare ``{"detail": ...}`` or, for a bad request, a 500. An
unknown route names the routes served (and the ``/v1`` a client's base URL lacks, where that is
the fault); a wrong method names the methods the route takes.
A client that left (Starlette's ``ClientDisconnect``) is not an error: nothing is sent, and only a
DEBUG line is logged.
Every response carries an ``x-request-id`` (OpenAI's header, which its client reports as
``_request_id``): a proxy's own ``X-Request-ID`` where it sent a plain one, else a new
``req_<hex>``; a 500's and a cancellation's log lines name it.
A bug is a 500, logged once with its traceback (``InternalErrors``). A request the server cancels
(uvicorn does, once ``--timeout-graceful-shutdown`` runs out) is a 503, "shutting down", like a turn
the engine's close drops: the JSON error, or in a stream already begun, the error event and the end
of the stream (``InternalErrors``).
A refusal to retry (a 429, a 503) says when: ``Retry-After`` in whole seconds and OpenAI's
``retry-after-ms``, spread by ``RetryAfter`` so that the clients refused together do not all come
back together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("examples.server")
# A request id taken from a proxy (nginx's $request_id, a load balancer's): printable and short,
# for it goes into a response header and the log.
_GIVEN_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def request_id(scope: Scope) -> bytes:
    """The request's id: the ``X-Request-ID`` a proxy sent where it is a plain one, else a new one."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id" and _GIVEN_ID.fullmatch(value):
            return value
    return b"req_" + uuid.uuid4().hex.encode()
_SESSION_ROUTE = "/v1/sessions/"


def redact_path(path: str) -> str:
    """``path`` with a session id in it replaced: ids are users' data (an e-mail, an account), and
    a DELETE of a session would otherwise write the very id it forgets into the server's logs."""
    if not path.startswith(_SESSION_ROUTE):
        return path
    query = path.find("?")
    return _SESSION_ROUTE + "<id>" + (path[query:] if query >= 0 else "")


class RedactSessionIds(logging.Filter):
    """For uvicorn's access log, whose records carry the request path among their arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_path(a) if isinstance(a, str) else a for a in record.args)
        return True


class ApiError(Exception):
    """A refusal with its HTTP status, OpenAI error fields and the headers that go with it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_GOLDEN = (math.sqrt(5) - 1) / 2


class RetryAfter:
    """The waits told to refused clients, spread over ``[seconds, 2 * seconds)``.

    One wait for every refusal sent a burst of clients refused together (a full queue, the turns a
    shutdown dropped) back together, into a queue that had freed one place, to be refused together
    again. Each call steps ``u`` by the golden ratio's fraction (mod 1): any run of consecutive
    refusals covers the interval about evenly (no two of them close, whatever their number), where
    random draws would bunch some, and the sequence is known from ``start`` (tests give one; by
    default a random one, so that servers behind one balancer do not tell the same waits in step).

    ``headers(seconds)``: ``retry-after-ms`` (what OpenAI's client reads first; 120 s is the most it
    waits, beyond which it does not retry at all) and ``Retry-After``, whole seconds (RFC 9110 has
    no fractions), rounded up so that a client reading either never comes back sooner.
    """

    def __init__(self, start: float | None = None) -> None:
        self._u = random.random() if start is None else start % 1.0

    def headers(self, seconds: float) -> dict[str, str]:
        self._u = (self._u + _GOLDEN) % 1.0
        ms = math.ceil(seconds * 1000 * (1 + self._u))
        return {"Retry-After": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}


# Shared by every refusal of the process (the middleware's 503s know no app): tests replace it.
RETRY = RetryAfter()
# A 503 for the shutdown: behind a balancer the retry goes to another server at once (uvicorn stopped
# listening at SIGTERM), and alone no fixed wait covers a restart (the client's connection errors back
# off on their own); spread, the dropped turns do not land on the other servers in one instant.
SHUTDOWN_RETRY_SECONDS = 1.0


def shutting_down() -> ApiError:
    """What a request the server will not finish, since it shuts down, is answered; its
    ``Retry-After`` spread by ``RETRY``."""
    return ApiError(503, "the server is shutting down; retry the request", type="server_error",
                    headers=RETRY.headers(SHUTDOWN_RETRY_SECONDS))


def sse_event(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON, as the chat stream sends its chunks and errors."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _param(loc: Sequence[int | str], fields: frozenset[str]) -> str | None:
    """``("messages", 0, "content", "str")`` -> ``"messages[0].content"``: pydantic appends union
    member tags (``str``, ``list[ContentPart]``) to a location, which are not parameters."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def from_validation(errors: Sequence[Any], fields: frozenset[str]) -> ApiError:
    """One 400 from pydantic's errors: the first parameter at fault, and every reason given for it.

    The offending input is never echoed: it can be large, binary, or a secret pasted by mistake.
    """
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first['msg']})", code="invalid_json")
    param = _param(first["loc"], fields)
    if param is None and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return ApiError(400, "the request body must be a JSON object", code="invalid_type")
    reasons = list(dict.fromkeys(e["msg"] for e in errors if _param(e["loc"], fields) == param))
    code = ("missing_required_parameter" if first["type"] == "missing"
            else "invalid_type" if first["type"].endswith("_type") else "invalid_value")
    return ApiError(400, f"{param or 'body'}: {'; or '.join(reasons)}", param=param, code=code)


class InternalErrors:
    """A route's unexpected exception as a 500 in OpenAI's shape, logged once with its traceback; a
    request the server cancels as a 503 (``shutting_down``), without a traceback.

    Starlette's own last resort (``ServerErrorMiddleware``) sends the 500 and then re-raises, for the
    server to log too: every bug was logged twice, the second time without the request. This one
    sits inside it and does not re-raise. Once a response has started, a 500 can no longer be sent:
    the exception goes on, for the server to log and to close the connection.

    Cancelled: uvicorn cancels the requests still running when ``--timeout-graceful-shutdown`` runs
    out, and logs whatever the app lets out, ``CancelledError`` included, as "Exception in ASGI
    application" with a traceback, then sends a bare 500 or cuts a stream short. Here the request
    is answered instead: a 503, or in an event stream already begun, the error event and the end of
    the stream (the turn itself was stopped by the engine's cleanup on the way out). The
    cancellation is then taken back (``uncancel``) and the app returns, which ends the request's
    task as the cancel meant to. Re-raised, not answered: a cancellation requested more than once
    (someone besides the server wants this task ended: it must go on ending), or one that arrives
    once a response began that is not an event stream (it cannot be ended honestly). A
    ``CancelledError`` that this task was not asked for (an awaited future someone cancelled) is a
    bug like any other: a 500.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = events = False
        rid = request_id(scope)
        send = _naming(send, rid)  # every response, a 500 and a 503 sent from here too

        async def watch(message: Message) -> None:
            nonlocal started, finished, events
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                events = content_type.split(b";")[0].strip().lower() == b"text/event-stream"
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            if cancels == 0:  # not a cancellation of this request: a bug
                await self._internal_error(scope, receive, send, started, rid)
                return
            if cancels > 1 or (started and not finished and not events):
                raise
            task.uncancel()  # type: ignore[union-attr]  # answered: the request ends here, as asked
            logger.info("%s %s cancelled by the server (shutting down): answered so (request %s)", scope["method"],
                        redact_path(scope["path"]), rid.decode())
            if not started:
                await shutting_down().response()(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": sse_event(shutting_down().body()).encode(),
                            "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:
            await self._internal_error(scope, receive, send, started, rid)

    @staticmethod
    async def _internal_error(scope: Scope, receive: Receive, send: Send, started: bool, rid: bytes) -> None:
        """Called in an ``except`` block: re-raises once a response has started."""
        if started:
            raise  # noqa: PLE0704 - the exception being handled
        # A bug, not a bad request: logged with its traceback here, and not described to the client,
        # whose report of its request id finds this line.
        logger.exception("internal error serving %s %s (request %s)", scope["method"], redact_path(scope["path"]),
                         rid.decode())
        await ApiError(500, "internal server error", type="server_error").response()(scope, receive, send)


def _naming(send: Send, rid: bytes) -> Send:
    """``send`` with ``x-request-id: rid`` in the response's headers (replacing one a route set)."""

    async def named(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
        await send(message)

    return named


def not_found(request: Request) -> str:
    """The 404's message: the routes this app serves, and, for a path that is one of them without
    its leading ``/v1`` (an OpenAI client's base URL given without it), that."""
    routes = [route for route in request.app.routes if isinstance(route, APIRoute) and route.include_in_schema]
    # HEAD goes with every GET (a load balancer's probe); listing it too would only double the list.
    served = ", ".join(f"{method} {route.path_format}" for route in routes
                       for method in sorted(route.methods - {"HEAD"} if "GET" in route.methods else route.methods))
    hint = ""
    if not request.url.path.startswith("/v1/"):
        moved = {**request.scope, "path": "/v1" + request.url.path, "root_path": ""}
        if any(route.matches(moved)[0] != Match.NONE for route in routes):
            hint = "; this one is under /v1 (an OpenAI client's base URL ends in /v1: http://host:port/v1)"
    return f"this server has no such route{hint}. It serves {served}"


def install(app: FastAPI, fields: frozenset[str]) -> None:
    """Render every refusal in OpenAI's shape; ``fields``: the request fields that may be named as
    ``param``."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI prefixes locations with where the value came from ("body", "path", "query").
        errors = [{**e, "loc": tuple(e["loc"][1:])} for e in exc.errors()] or [{"type": "value_error",
                                                                                  "loc": (), "msg": "invalid"}]
        return from_validation(errors, fields).response()

    @app.exception_handler(ValidationError)
    async def validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc.errors(include_url=False), fields).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        headers = getattr(exc, "headers", None) or {}
        # Starlette's bare "Not Found" and "Method Not Allowed" do not say what to send instead.
        if exc.status_code == 404 and message == "Not Found":
            message = not_found(request)
        elif exc.status_code == 405 and "Allow" in headers:
            message = (f"{request.method} is not allowed on {redact_path(request.url.path)}; send "
                       f"{' or '.join(headers['Allow'].split(', '))}")
        error = ApiError(exc.status_code, message, code=codes.get(exc.status_code), type=type_)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # While sending its body, or while its turn waited: the server sends nothing to a closed
        # connection, so the status (nginx's "client closed request") only shows in tests.
        logger.debug("the client of %s %s disconnected", request.method, redact_path(request.url.path))
        return Response(status_code=499)

    app.add_middleware(InternalErrors)
