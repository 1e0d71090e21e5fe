"""The chat server example (examples/server) over real HTTP, against plain transformers.

One server per module: uvicorn in a background thread on 127.0.0.1 (a socket bound to a free port),
a tmp store with small budgets (sessions move between tiers), the tiny model at 2 layers, greedy
replies of a few tokens; clients are httpx, and the official openai client (skipped where it is not
installed) as a user of the README's server drives it. Each test speaks as its own tenant (API key), so no
test hits another's blocks. One more test runs ``python -m examples.server`` as a subprocess. Where
what matters is what the app lets out to the server (an exception, which the server logs), the
test calls the served app as an ASGI app directly (``call_asgi``).
"""

from __future__ import annotations

import codecs
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import lmdb
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from examples.server import errors
from examples.server.app import ServerState, create_app, tenant_name
from examples.server.engine import build_model
from examples.server.settings import Settings
from examples.server.tokenizer import VOCAB_SIZE
from tierkv import TieredStore

ROOT = Path(__file__).resolve().parents[1]
# About 1 KiB of KV per token: the device holds ~64 tokens and the host ~128, the rest is on disk.
SMALL = dict(tiny_layers=2, tiny_hidden=64, block_size=8, device_budget="64KiB", host_budget="128KiB",
             max_input_tokens=600, max_output_tokens=64, default_max_tokens=8, max_body_bytes=64 * 1024)


@dataclass
class Server:
    url: str
    settings: Settings
    state: ServerState
    app: FastAPI

    def post(self, body: Any, key: str | None = None, session: str | None = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        headers = dict(headers or {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if session is not None:
            headers["X-Session-ID"] = session
        if raw is not None:
            return httpx.post(f"{self.url}/v1/chat/completions", content=raw, headers=headers, timeout=60)
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=60)

    def chat(self, messages: list[dict[str, Any]], key: str, session: str | None = None,
             **fields: Any) -> dict[str, Any]:
        """A greedy turn that must succeed; ``fields`` override the request's."""
        r = self.post({"model": "test-model", "messages": messages, "temperature": 0, "max_tokens": 8, **fields},
                      key=key, session=session)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, messages: list[dict[str, Any]], key: str, session: str | None = None,
               **fields: Any) -> list[Any]:
        """The decoded ``data:`` payloads of a streamed greedy turn; ``[DONE]`` stays a string."""
        body = {"model": "test-model", "messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}, **fields}
        headers = {"Authorization": f"Bearer {key}", **({"X-Session-ID": session} if session else {})}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            # Keep-alive comments come whenever a turn is slower than the server's setting (a busy
            # machine, the busy fixture's 0.05 s); their own test counts them.
            lines = [line for line in r.iter_lines() if line and line != ": keep-alive"]
        assert all(line.startswith("data: ") for line in lines), lines
        return [p if p == "[DONE]" else json.loads(p) for p in (line[len("data: "):] for line in lines)]


def start_uvicorn(app: Any, name: str, send_buffer: int | None = None,
                  **config: Any) -> tuple[Any, threading.Thread, socket.socket, str]:
    """Serve ``app`` on a port of its own in a daemon thread, once uvicorn says it started: the
    server, its thread, its socket (bound here and handed to uvicorn: no race for the port) and
    its URL. ``send_buffer``: the kernel's send buffer of each connection, in bytes (its default
    grows with the traffic)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return uv, thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.contextmanager
def served(settings: Settings, name: str, **config: Any) -> Iterator[Server]:
    """The app of ``settings`` under uvicorn in a thread named ``name``, stopped on exit; ``config``:
    ``start_uvicorn``'s."""
    app = create_app(settings)
    uv, thread, sock, url = start_uvicorn(app, name, **config)
    try:
        yield Server(url, settings, app.state.server, app)
    finally:
        uv.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with served(Settings(store=str(tmp_path_factory.mktemp("server") / "kv"), **SMALL), "test-uvicorn") as running:
        yield running


def text(response: dict[str, Any]) -> str:
    return response["choices"][0]["message"]["content"]


def cached(response: dict[str, Any]) -> int:
    details = response["usage"]["prompt_tokens_details"]
    assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"]
    return details["cached_tokens"]


def conversation(tag: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"You are the {tag} assistant."},
            {"role": "user", "content": f"Hello, this is the {tag} test speaking."}]


def follow_up(messages: list[dict[str, Any]], response: dict[str, Any], question: str) -> list[dict[str, Any]]:
    """The next turn as a client sends it: the history, the reply as returned, a new question."""
    return [*messages, response["choices"][0]["message"], {"role": "user", "content": question}]


def test_each_turn_restores_the_whole_previous_conversation_including_the_reply(server: Server) -> None:
    messages = conversation("turns")
    first = server.chat(messages, key="k-turns", session="alice")
    assert first["object"] == "chat.completion" and first["model"] == "test-model"
    assert cached(first) == 0
    previous = first
    for question in ("Tell me more.", "And then?"):
        messages = follow_up(messages, previous, question)
        reply = server.chat(messages, key="k-turns", session="alice")
        used = previous["usage"]
        # Every token of the previous turn but the reply's last one, whose KV generate never computed.
        assert cached(reply) == used["prompt_tokens"] + used["completion_tokens"] - 1
        assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
        previous = reply


def test_other_tenants_restore_nothing_and_api_keys_never_reach_the_disk(server: Server) -> None:
    key = "sk-tenant-a-SECRET-7f3e9c"
    messages = conversation("tenants")
    first = server.chat(messages, key=key, session="s")
    second = follow_up(messages, first, "Still there?")
    assert cached(server.chat(second, key="sk-tenant-b", session="s")) == 0  # same session name, other tenant
    assert cached(server.chat(second, key="sk-tenant-c")) == 0               # no session at all
    # X-API-Key names the same tenant as a bearer token; without a session the tenant's prefix still hits.
    r = server.post({"messages": second, "temperature": 0, "max_tokens": 4}, headers={"X-API-Key": key})
    assert r.status_code == 200 and cached(r.json()) > 0

    server.state.store.flush()
    files = b"".join(p.read_bytes() for p in Path(server.settings.store or "").rglob("*") if p.is_file())
    assert tenant_name(key).encode() in files  # the tenant is on disk, as its digest...
    assert key.encode() not in files           # ...and the key is not


def test_deleting_a_session_forgets_it_for_its_own_tenant_only(server: Server) -> None:
    messages = conversation("delete")
    first = server.chat(messages, key="k-del", session="bob")
    other = httpx.delete(f"{server.url}/v1/sessions/bob", headers={"X-API-Key": "k-del-other"}, timeout=30)
    assert other.status_code == 200 and other.json()["blocks_removed"] == 0
    again = server.chat(messages, key="k-del", session="bob")
    assert cached(again) == again["usage"]["prompt_tokens"] - 1 and text(again) == text(first)

    gone = httpx.delete(f"{server.url}/v1/sessions/bob", headers={"Authorization": "Bearer k-del"}, timeout=30)
    assert gone.status_code == 200
    assert gone.json()["object"] == "session.deleted" and gone.json()["blocks_removed"] > 0
    assert cached(server.chat(messages, key="k-del", session="bob")) == 0


def test_the_session_header_wins_over_the_body_s_user(server: Server) -> None:
    server.chat(conversation("header wins"), key="k-wins", session="from-header", user="from-user")
    for sid, removed in (("from-user", False), ("from-header", True)):
        gone = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers={"X-API-Key": "k-wins"}, timeout=30)
        assert gone.status_code == 200 and (gone.json()["blocks_removed"] > 0) == removed, sid


def test_a_session_or_api_key_header_sent_twice_is_refused(server: Server) -> None:
    # The first was taken, where a proxy may join the two ("a, b") or keep the last: one request
    # named another session, or tenant, depending on the way it came.
    body = {"messages": conversation("twice"), "max_tokens": 1}
    for headers, status in (([("X-API-Key", "k-twice"), ("X-Session-ID", "a"), ("X-Session-ID", "b")], 400),
                            ([("Authorization", "Bearer k-twice"), ("Authorization", "Bearer k-other")], 401),
                            ([("X-API-Key", "k-twice"), ("X-API-Key", "k-other")], 401)):
        answers = [httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)]
        if status == 401:  # a DELETE's tenant too (its session is the path's)
            answers.append(httpx.delete(f"{server.url}/v1/sessions/a", headers=headers, timeout=30))
        for r in answers:
            error = r.json()["error"]
            assert r.status_code == status and "headers; send one" in error["message"], r.text
    # One of each is what a client sends.
    assert server.post(body, headers={"X-API-Key": "k-twice", "X-Session-ID": "a"}).status_code == 200


def test_a_delete_comes_after_the_session_s_turns_already_queued(server: Server,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Else the queued turn commits the session back right after it was forgotten.
    messages = conversation("delete queued")
    store, forgotten = server.state.store, threading.Event()
    forget = store.forget

    def noted(*args: Any, **kwargs: Any) -> int:
        forgotten.set()
        return forget(*args, **kwargs)

    monkeypatch.setattr(store, "forget", noted)
    gate = threading.Event()
    held = server.state.engine.submit(gate.wait)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            turn = pool.submit(server.chat, messages, "k-del-queued", "q")
            wait_for_pending(server, 1, "the turn was never queued")
            gone = pool.submit(httpx.delete, f"{server.url}/v1/sessions/q", headers={"X-API-Key": "k-del-queued"},
                               timeout=30)
            deadline = time.monotonic() + 30  # until the delete arrived: queued behind the turn, or done
            while server.state.engine._executor._work_queue.qsize() < 2 and not forgotten.is_set():
                assert time.monotonic() < deadline, "the delete never arrived"
                time.sleep(0.02)
            gate.set()
            turn.result(timeout=60)
            assert gone.result(timeout=60).json()["blocks_removed"] > 0
    finally:
        gate.set()
        held.result(timeout=60)
    assert cached(server.chat(messages, key="k-del-queued", session="q")) == 0


def test_a_session_id_with_a_slash_can_be_deleted(server: Server) -> None:
    messages = conversation("slash")
    first = server.chat(messages, key="k-slash", session="team/alice")
    again = server.chat(follow_up(messages, first, "More?"), key="k-slash", session="team/alice")
    assert cached(again) > 0
    gone = httpx.delete(f"{server.url}/v1/sessions/team%2Falice", headers={"X-API-Key": "k-slash"}, timeout=30)
    assert gone.status_code == 200 and gone.json()["id"] == "team/alice" and gone.json()["blocks_removed"] > 0
    assert cached(server.chat(follow_up(messages, first, "More?"), key="k-slash", session="team/alice")) == 0


def test_a_non_ascii_session_id_in_the_header_is_the_one_its_delete_forgets(server: Server) -> None:
    messages = conversation("utf-8")
    sid = "café-Ω"  # sent as UTF-8 bytes, as clients send a header; Starlette would read them as latin-1
    header = {"X-Session-ID": sid.encode("utf-8")}
    first = server.post({"messages": messages, "temperature": 0, "max_tokens": 8}, key="k-utf8", headers=header)
    assert first.status_code == 200, first.text
    again = server.post({"messages": follow_up(messages, first.json(), "More?"), "temperature": 0, "max_tokens": 8},
                        key="k-utf8", headers=header)
    assert cached(again.json()) > 0
    gone = httpx.delete(f"{server.url}/v1/sessions/caf%C3%A9-%CE%A9", headers={"X-API-Key": "k-utf8"}, timeout=30)
    assert gone.status_code == 200 and gone.json()["id"] == sid and gone.json()["blocks_removed"] > 0
    assert cached(server.chat(messages, key="k-utf8")) == 0  # nothing of it is left
    again = httpx.delete(f"{server.url}/v1/sessions/caf%C3%A9-%CE%A9", headers={"X-API-Key": "k-utf8"}, timeout=30)
    assert again.status_code == 200 and again.json()["blocks_removed"] == 0  # found nothing: still 200, as documented

    bad = server.post({"messages": messages}, key="k-utf8", headers={"X-Session-ID": b"caf\xe9"})  # latin-1 bytes
    assert bad.status_code == 400 and "not UTF-8" in bad.json()["error"]["message"], bad.text


@pytest.mark.parametrize("where, sid, reason", [
    ("user", " chat 1 ", "begins or ends with whitespace"),
    ("user", "chat 1\n", "begins or ends with whitespace"),
    ("user", "chat\u00001", "control character"),
    ("header", "\u00a0chat 1".encode(), "begins or ends with whitespace"),  # HTTP trims spaces and tabs only
    ("header", b"chat\t1", "control character"),
    ("path", "chat%201%20", "begins or ends with whitespace"),  # the header " chat 1 " arrives as "chat 1"
    ("path", "%20chat", "begins or ends with whitespace"),
    ("path", "chat%0A1", "control character"),
    ("path", "caf%E9", "not percent-encoded UTF-8"),  # else read as "caf\ufffd", as is caf%FF
    ("path", "", "names no session"),
])
def test_session_ids_that_would_name_two_sessions_are_refused(server: Server, where: str, sid: Any,
                                                               reason: str) -> None:
    body = {"messages": conversation("ids"), "max_tokens": 1, **({"user": sid} if where == "user" else {})}
    if where == "path":
        r = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers={"X-API-Key": "k-ids"}, timeout=30)
    else:
        r = server.post(body, key="k-ids", headers={"X-Session-ID": sid} if where == "header" else None)
    assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == ("user" if where == "user" else None)


def test_the_access_log_does_not_name_the_session_a_delete_forgets(server: Server) -> None:
    access = logging.getLogger("uvicorn.access")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = Keep(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)  # the test server logs warnings only; `python -m examples.server` logs this
    try:
        server.chat(conversation("logged"), key="k-log", session="alice@example.com")
        gone = httpx.delete(f"{server.url}/v1/sessions/alice%40example.com?x=1", headers={"X-API-Key": "k-log"},
                            timeout=30)
        assert gone.status_code == 200 and gone.json()["id"] == "alice@example.com"
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert any("DELETE /v1/sessions/<id>?x=1" in line for line in lines), lines
    assert not [line for line in lines if "alice" in line]


def test_a_vanishing_temperature_is_greedy_not_a_server_error(server: Server) -> None:
    messages = conversation("tiny-temperature")
    greedy = server.chat(messages, key="k-temp", session="g")
    tiny = server.chat(messages, key="k-temp", session="t", temperature=1e-40)  # 1/T overflows float32
    assert text(tiny) == text(greedy)
    # top_p 0 is in OpenAI's range (it was refused): only the most likely token, whatever the temperature.
    for temperature in (None, 2):
        nucleus = server.post({"messages": messages, "max_tokens": 8, "top_p": 0, "temperature": temperature},
                              key="k-temp")
        assert nucleus.status_code == 200 and text(nucleus.json()) == text(greedy), nucleus.text


def test_streaming_delivers_the_non_streamed_reply_and_commits(server: Server) -> None:
    messages = conversation("stream")
    plain = server.chat(messages, key="k-stream", session="plain", max_tokens=16)
    events = server.stream(messages, key="k-stream", session="streamed", max_tokens=16)

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(content) == text(plain)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == plain["choices"][0]["finish_reason"] and not any(finish[:-1])
    usage_chunk = chunks[-1]  # include_usage: a last chunk without choices
    assert usage_chunk["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    assert usage_chunk["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert usage_chunk["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]

    # The streamed turn was committed: its session's next turn restores all of it.
    nxt = server.chat(follow_up(messages, plain, "Go on."), key="k-stream", session="streamed")
    assert cached(nxt) == plain["usage"]["prompt_tokens"] + plain["usage"]["completion_tokens"] - 1


def test_a_stream_without_include_usage_has_no_usage(server: Server) -> None:
    messages = conversation("no usage")
    for options in ({}, {"stream_options": {}}, {"stream_options": {"include_usage": False}}):
        events = server.stream(messages, key="k-no-usage", **{"stream_options": None, **options})
        assert events[-1] == "[DONE]" and all(c["choices"] and "usage" not in c for c in events[:-1]), options


def test_stop_strings_cut_the_reply_streamed_or_not(server: Server) -> None:
    messages = conversation("stop")
    full = text(server.chat(messages, key="k-stop", max_tokens=24))
    assert len(full) >= 11, "the conversation must yield a reply long enough to cut"
    # Two stops the same token completes, the later one found first: the reply ends before the earlier.
    end = next(j for j in range(3, len(full)) if full[j - 1] not in full[:j - 1])
    # One character (nothing held back), two, three, and two stops at once: the token completing a
    # stop string reaches the stream before generation stops, and none of the stop may be sent.
    for stop in ([full[5]], [full[0]], [full[5:7]], full[3:6], [full[8:10], full[6]], [full[9:11], "@@@@"],
                 [full[end - 1], full[end - 3:end]]):
        stops = [stop] if isinstance(stop, str) else stop
        cut = server.chat(messages, key="k-stop", max_tokens=24, stop=stop)
        at = min(i for i in (full.find(s) for s in stops) if i >= 0)
        assert text(cut) == full[:at] and cut["choices"][0]["finish_reason"] == "stop", stop
        # Generation stops at the token completing the first stop string (one byte per token), not at max_tokens.
        assert cut["usage"]["completion_tokens"] == min(full.find(s) + len(s) for s in stops if s in full), stop
        events = server.stream(messages, key="k-stop", max_tokens=24, stop=stop)
        deltas = [c["choices"][0]["delta"]["content"] for c in events[1:-1]
                  if c["choices"] and "content" in c["choices"][0]["delta"]]
        assert "".join(deltas) == text(cut) and all(deltas), (stop, deltas)  # no empty chunk while a stop is held
    # The prompt's text is not the reply's: a stop string the user's message ends with stops nothing.
    assert "speaking." not in full and messages[-1]["content"].endswith("speaking.")
    assert text(server.chat(messages, key="k-stop", max_tokens=24, stop="speaking.")) == full


def test_max_tokens_its_default_and_limit_and_the_finish_reason_of_each_end(server: Server) -> None:
    messages = conversation("finish")
    no_end = {"260": -100}  # <|end|>: the reply runs to its limit
    body = {"messages": messages, "temperature": 0, "logit_bias": no_end}

    def tokens(**fields: Any) -> dict[str, Any]:
        r = server.post({**body, **fields}, key="k-finish")
        assert r.status_code == 200, r.text
        return r.json()

    default = tokens()
    assert default["usage"]["completion_tokens"] == server.settings.default_max_tokens
    assert default["choices"][0]["finish_reason"] == "length"
    newer = tokens(max_tokens=3, max_completion_tokens=5)  # OpenAI's newer name wins
    assert newer["usage"]["completion_tokens"] == 5
    limit = server.settings.max_output_tokens  # the limit itself is accepted
    assert tokens(max_tokens=limit)["usage"]["completion_tokens"] == limit
    ended = tokens(max_tokens=4, logit_bias={"260": 100})
    assert ended["choices"][0]["finish_reason"] == "stop" and text(ended) == ""
    assert ended["usage"]["completion_tokens"] == 1


def test_concurrent_sessions_each_get_the_reply_they_get_alone(server: Server) -> None:
    convs = [conversation(f"concurrent {i}") for i in range(4)]
    alone = [text(server.chat(c, key="k-conc", session=f"alone-{i}")) for i, c in enumerate(convs)]
    with concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:
        together = list(pool.map(lambda ic: server.chat(ic[1], key="k-conc", session=f"together-{ic[0]}"),
                                 enumerate(convs)))
    assert [text(r) for r in together] == alone


def test_the_event_loop_answers_while_turns_wait_for_the_model(server: Server) -> None:
    # Hold the engine's worker, so a turn is queued for as long as this test decides.
    gate = threading.Event()
    held = server.state.engine.submit(gate.wait)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            turn = pool.submit(server.chat, conversation("queued"), "k-queue", "q")
            deadline = time.monotonic() + 30
            while True:
                health = httpx.get(f"{server.url}/healthz", timeout=5)
                assert health.status_code == 200 and health.json()["status"] == "ok"
                if health.json()["pending_turns"] == 1:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert not turn.done()
            gate.set()
            assert cached(turn.result(timeout=60)) == 0
    finally:
        gate.set()
        held.result(timeout=60)


def test_an_abandoned_queued_stream_is_dropped_and_frees_its_place(server: Server) -> None:
    messages = conversation("abandoned")
    body = {"messages": messages, "temperature": 0, "max_tokens": 8, "stream": True}
    gate = threading.Event()
    held = server.state.engine.submit(gate.wait)
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"X-API-Key": "k-gone", "X-Session-ID": "gone"}) as r:
            role = json.loads(next(r.iter_lines())[len("data: "):])
            assert role["choices"][0]["delta"]["role"] == "assistant"
        # The client left while its turn was queued: the server notices, and the turn leaves the queue.
        wait_for_pending(server, 0, "the abandoned turn was never dropped")
    finally:
        gate.set()
        held.result(timeout=60)
    # Had the turn run, it would have committed this very prompt.
    assert cached(server.chat(messages, key="k-gone", session="gone")) == 0


def wait_for_pending(server: Server, turns: int, failure: str) -> None:
    """Until the server's queue holds ``turns`` turns (30 s at most)."""
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/healthz", timeout=5).json()["pending_turns"] != turns:
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


class Records(logging.Handler):
    """The records of ``loggers`` while in use, at ``level`` and above."""

    def __init__(self, *loggers: str, level: int = logging.ERROR) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self._loggers = [logging.getLogger(name) for name in loggers]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "Records":
        for logger in self._loggers:
            logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for logger in self._loggers:
            logger.removeHandler(self)


def test_an_abandoned_queued_non_streamed_turn_is_dropped_too(server: Server) -> None:
    messages = conversation("abandoned plain")
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 8}).encode()
    gate = threading.Event()
    held = server.state.engine.submit(gate.wait)
    try:
        with Records("examples.server", "uvicorn.error") as logged:
            host, port = server.url.removeprefix("http://").split(":")
            client = socket.create_connection((host, int(port)), timeout=30)
            with client:
                client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nX-API-Key: k-gone-plain\r\n"
                               b"X-Session-ID: gone\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                wait_for_pending(server, 1, "the turn was never queued")
            # The client left while its turn was queued: the server notices, and the turn leaves the queue.
            wait_for_pending(server, 0, "the abandoned turn was never dropped")
    finally:
        gate.set()
        held.result(timeout=60)
    assert not logged.records, [r.getMessage() for r in logged.records]
    # Had the turn run, it would have committed this very prompt.
    assert cached(server.chat(messages, key="k-gone-plain", session="gone")) == 0


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own whose streams send a keep-alive comment after 0.05 s of silence and whose
    queue holds 3 turns, so that these tests can fill it."""
    settings = Settings(store=str(tmp_path_factory.mktemp("busy") / "kv"), sse_keep_alive=0.05, max_pending_turns=3,
                        **SMALL)
    with served(settings, "test-uvicorn-busy") as running:
        yield running


def test_a_queued_stream_sends_keep_alive_comments_and_the_same_content(busy: Server) -> None:
    # A queued stream sent nothing after its role chunk until its turn began: a proxy's idle timeout
    # (nginx's 60 s) cut it, and the turn was then dropped as abandoned.
    messages = conversation("kept alive")
    alone = busy.stream(messages, key="k-alive-alone")
    body = {"model": "test-model", "messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    gate = threading.Event()
    held = busy.state.engine.submit(gate.wait)  # the turn stays queued until the comments came
    try:
        with httpx.stream("POST", f"{busy.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"X-API-Key": "k-alive"}) as r:
            lines = r.iter_lines()
            seen = [next(lines)]
            while seen.count(": keep-alive") < 2:
                seen.append(next(lines))
            assert httpx.get(f"{busy.url}/healthz", timeout=5).json()["pending_turns"] == 1  # still queued
            gate.set()
            seen.extend(lines)
    finally:
        gate.set()
        held.result(timeout=60)
    assert seen[0].startswith("data: ") and all(line.startswith(("data: ", ": ")) for line in seen if line)
    payloads = [p if p == "[DONE]" else json.loads(p)
                for p in (line[len("data: "):] for line in seen if line.startswith("data: "))]
    for got in (payloads, alone):  # ids and times differ from stream to stream
        for p in got[:-1]:
            del p["id"], p["created"]
    assert payloads == alone and payloads[-1] == "[DONE]"


def test_a_full_queue_refuses_with_429_and_retry_after_leaving_the_queued_turns_alone(
        busy: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every request waited in an unbounded queue. The limit counts streams as their requests come,
    # not when their responses start: a burst of streams all saw a count their neighbours had not
    # raised yet.
    monkeypatch.setattr(errors, "RETRY", errors.RetryAfter(0.0))  # the spread's sequence, from its start
    # Distinct from their first character on, so that no prompt hits another's blocks.
    convs = [[{"role": "user", "content": f"{i} is the number of this queued turn."}] for i in range(8)]
    alone = [text(busy.chat(c, key="k-full-alone")) for c in convs]
    body = {"temperature": 0, "max_tokens": 8, "stream": True}
    gate = threading.Event()
    held = busy.state.engine.submit(gate.wait)  # the running turn: the queue holds whatever comes now
    # Turns of 7.2 s on average: a place frees in about that, which Retry-After says (it said 1 s
    # whatever the turns took, so clients of slow turns came back several times per place), spread
    # over [7.2, 14.4) s (it said 8 s to every client of a burst, which came back together).
    assert busy.state.engine.turn_seconds is not None  # measured by the turns above
    busy.state.engine.turn_seconds = 7.2
    # 7.2 s * (1 + u), u stepping by 0.618... from 0; Retry-After: the same in whole seconds, rounded up.
    waits = [("12", "11650"), ("9", "8900"), ("14", "13350"), ("11", "10600"), ("8", "7850"), ("13", "12300"),
             ("10", "9549")]
    pool = concurrent.futures.ThreadPoolExecutor(len(convs))
    try:
        def stream(i: int) -> tuple[int, list[str], httpx.Headers]:
            with httpx.stream("POST", f"{busy.url}/v1/chat/completions", json={**body, "messages": convs[i]},
                              headers={"X-API-Key": "k-full"}, timeout=60) as r:
                return r.status_code, list(r.iter_lines()), r.headers

        started = [pool.submit(stream, i) for i in range(len(convs))]  # at once
        deadline = time.monotonic() + 30
        while sum(f.done() for f in started) < len(convs) - 3:  # the refused end; the others wait
            assert time.monotonic() < deadline, "the requests past the limit were never refused"
            time.sleep(0.02)
        wait_for_pending(busy, 3, "the three turns the queue holds were never queued")
        # The same full queue, for a request not streamed.
        r = busy.post({"messages": convs[0], "temperature": 0, "max_tokens": 8}, key="k-full")
        assert r.status_code == 429 and (r.headers["retry-after"], r.headers["retry-after-ms"]) == waits[5], r.text
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "3 turns (or session deletes) are queued or running already" in error["message"]
        assert busy.state.engine.pending == 3
        # A session delete, queued on the same worker behind the turns, is refused alike.
        r = httpx.delete(f"{busy.url}/v1/sessions/s", headers={"X-API-Key": "k-full"})
        assert r.status_code == 429 and (r.headers["retry-after"], r.headers["retry-after-ms"]) == waits[6]
        assert "retry after 10 s" in r.text
        gate.set()
        outcomes = [f.result(timeout=60) for f in started]
    finally:
        gate.set()  # before the pool waits for its requests: a failure above must not wait on them
        held.result(timeout=60)
        pool.shutdown()
    accepted = [i for i, (status, _, _) in enumerate(outcomes) if status == 200]
    assert len(accepted) == 3, [status for status, _, _ in outcomes]
    # The five refused streams, in whatever order they came: the sequence's first five waits.
    assert sorted((h["retry-after"], h["retry-after-ms"]) for status, _, h in outcomes if status == 429) == sorted(
        waits[:5])
    for i, (status, lines, headers) in enumerate(outcomes):
        if status == 429:
            assert json.loads("".join(lines))["error"]["type"] == "rate_limit_error"
        else:  # the queued turns finish as they would alone
            payloads = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
            assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == alone[i]
    wait_for_pending(busy, 0, "the queue never emptied")
    # Refused before the store: the refused prompts were not committed, the accepted ones were.
    # (Beyond the 2 tokens of the chat template's opening, which every conversation shares.)
    assert [cached(busy.chat(c, key="k-full")) > 2 for c in convs] == [i in accepted for i in range(len(convs))]


def test_retry_after_is_about_one_turn_spread_over_the_next(busy: Server) -> None:
    engine, measured = busy.state.engine, busy.state.engine.turn_seconds
    try:
        answers = []
        for seconds in (None, 0.01, 1.0, 1.01, 7.2, 3600.0):
            engine.turn_seconds = seconds
            answers.append(engine.retry_after())
        assert answers == [1.0, 1.0, 1.0, 1.01, 7.2, 60.0]  # never 0 (retry at once), never an hour
    finally:
        engine.turn_seconds = measured
    # Any run of refusals, from any start, is told waits spread over [10, 20) s: no two close, no gap
    # wide (0.45 and 1.9 of an even spread's, the golden ratio's bounds).
    for start in (0.0, 0.37, 0.999):
        spread = errors.RetryAfter(start)
        told = [spread.headers(10.0) for _ in range(100)]
        assert [h["Retry-After"] for h in told] == [str(math.ceil(int(h["retry-after-ms"]) / 1000)) for h in told]
        ms = [int(h["retry-after-ms"]) for h in told]
        assert 10_000 <= min(ms) and max(ms) <= 20_000
        for n in range(2, len(ms) + 1):
            points = sorted(ms[:n])
            gaps = [b - a for a, b in zip(points, points[1:])] + [points[0] + 10_000 - points[-1]]
            assert 0.4 * 10_000 / n <= min(gaps) and max(gaps) <= 2 * 10_000 / n, (start, n)


def test_a_queued_session_delete_holds_a_place_in_the_queue(busy: Server) -> None:
    # DELETEs queued on the worker without being counted: a flood of them grew the queue without
    # bound, ahead of the turns sent after them, while /healthz said it was empty.
    gate = threading.Event()
    held = busy.state.engine.submit(gate.wait)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        deleted = pool.submit(httpx.delete, f"{busy.url}/v1/sessions/queued", headers={"X-API-Key": "k-del"},
                              timeout=60)
        wait_for_pending(busy, 1, "the queued delete holds no place in the queue")
        gate.set()
        assert deleted.result(timeout=60).json()["deleted"] is True
    finally:
        gate.set()
        held.result(timeout=60)
        pool.shutdown()
    wait_for_pending(busy, 0, "the delete never gave its place back")


def test_a_stream_holds_its_place_in_the_queue_from_its_request_on() -> None:
    # A stream's generator counts its turn only once its response has started: requests that came
    # in between saw the queue with room, and a stream whose response never started held nothing.
    # Counted at the request, it must be given back by a response that never started.
    import asyncio

    state = ServerState.start(Settings(store=None, max_pending_turns=1, **SMALL))
    app = create_app(state.settings)
    app.state.server = state
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    json_type = [(b"content-type", b"application/json")]

    async def request(payload: dict[str, Any], hold: asyncio.Event | None = None,
                      held: asyncio.Event | None = None) -> list[dict[str, Any]]:
        scope = {**ASGI_SCOPE, "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "headers": json_type}
        receive = receiving([{"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}])
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if hold is not None and held is not None and message["type"] == "http.response.start":
                held.set()
                await hold.wait()  # a slow network: the stream's generator has not started

        await app(scope, receive, send)
        return sent

    async def scenario() -> None:
        hold, held = asyncio.Event(), asyncio.Event()
        stream = asyncio.ensure_future(request({**body, "stream": True}, hold, held))
        await asyncio.wait_for(held.wait(), 30)
        assert state.engine.pending == 1 and not stream.done()
        refused = await request(body)
        told = dict(refused[0]["headers"])  # 1 s before any turn ran, spread over the next
        assert refused[0]["status"] == 429 and told[b"retry-after"] in (b"1", b"2")
        assert 1000 <= int(told[b"retry-after-ms"]) < 2000
        assert state.engine.pending == 1
        stream.cancel()  # its connection is gone before the response began
        await asyncio.wait([stream])
        assert state.engine.pending == 0, "a stream that never started kept its place"
        done = await request({**body, "stream": True})
        assert done[0]["status"] == 200 and b"data: [DONE]" in b"".join(m.get("body", b"") for m in done[1:])
        assert (await request(body))[0]["status"] == 200 and state.engine.pending == 0

    try:
        asyncio.run(scenario())
    finally:
        state.close()


def hold_after_first_token(model: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Patch ``model.forward`` to hold a turn at its second forward (after its first token) until
    ``release`` is set; ``running`` is set once it holds there."""
    forward = model.forward
    calls, running, release = [0], threading.Event(), threading.Event()

    @functools.wraps(forward)  # generate reads the forward's signature
    def gated(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            running.set()
            release.wait(30)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", gated)
    return running, release


@pytest.mark.parametrize("streamed", [False, True])
def test_a_running_turn_whose_client_left_stops_at_its_next_token(server: Server, monkeypatch: pytest.MonkeyPatch,
                                                                  streamed: bool) -> None:
    engine = server.state.engine
    model = engine.model
    running, release = hold_after_first_token(model, monkeypatch)
    results: list[Any] = []
    run = engine._run

    def recorded(*args: Any) -> Any:
        results.append(run(*args))
        return results[-1]

    monkeypatch.setattr(engine, "_run", recorded)
    body = json.dumps({"messages": conversation(f"left running {streamed}"), "temperature": 0, "max_tokens": 64,
                       "logit_bias": {"260": -100}, "stream": streamed}).encode()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nX-API-Key: k-left-running\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert running.wait(30), "the turn never started"
        wait_for_pending(server, 0, "the server never noticed the client leave")
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while not results:
        assert time.monotonic() < deadline, "the turn never ended"
        time.sleep(0.02)
    # Two tokens (the one generated when the client left, the next one), not 64.
    assert results[0].completion_tokens == 2 and results[0].finish_reason == "length"


def unchunk(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 response sent with ``Transfer-Encoding: chunked``, its head cut off."""
    rest, body = raw.split(b"\r\n\r\n", 1)[1], b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if not int(size, 16):
            return body
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]


def test_a_stream_whose_client_reads_nothing_gives_its_place_back_once_its_turn_ends() -> None:
    # A stream held its place in the queue until its client had read the whole reply: a client that
    # kept its connection but read nothing held it for good once the socket's buffers were full, its
    # turn long done and committed, and --max-pending-turns such clients had every other request
    # refused with a 429. The worker never waits for a client: its place is the queue's, not the socket's.
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class SmallWriteBuffer(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        """uvicorn's protocol, its connections waiting for the socket past 1 KiB unsent (asyncio's 64 KiB)."""

        def connection_made(self, transport: Any) -> None:
            transport.set_write_buffer_limits(high=1024)
            super().connection_made(transport)

    settings = Settings(store=None, max_pending_turns=1, **SMALL)
    with served(settings, "test-uvicorn-unread", send_buffer=4096, http=SmallWriteBuffer) as server:
        # The model's name is echoed in each chunk: about 33 KB in all, twice what the buffers hold.
        fields = {"model": "m" * 256, "messages": conversation("unread"), "temperature": 0, "max_tokens": 64,
                  "logit_bias": {"260": -100}}
        body = json.dumps({**fields, "stream": True}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            client.settimeout(60)
            client.connect((host, int(port)))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nX-API-Key: k-unread\r\n"
                           b"Connection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(body), body))
            wait_for_pending(server, 0, "the stream whose client reads nothing kept its place after its turn ended")
            whole = server.post(fields, key="k-unread")  # served, not refused: the queue's one place is free
            assert whole.status_code == 200, whole.text
            received = b""
            while chunk := client.recv(1 << 16):  # at last: the whole stream, nothing lost while it waited
                received += chunk
        events = [line[len(b"data: "):] for line in unchunk(received).split(b"\n\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        content = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert len(content) == 64 and content == text(whole.json())


ASGI_SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "query_string": b"",
              "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


def receiving(messages: list[dict[str, Any]]) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` handing out ``messages``, then waiting for good: a client that sends
    nothing more."""
    import asyncio

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()
        raise AssertionError

    return receive


def call_asgi(app: FastAPI, method: str, path: str, headers: list[tuple[bytes, bytes]],
              received: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``app`` sends for one request whose client sends ``received`` (then waits): no server
    between, so an exception the app lets out (which a server logs) fails the test."""
    import asyncio

    scope = {**ASGI_SCOPE, "method": method, "path": path, "raw_path": path.encode(), "headers": headers}
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        receive = receiving(list(received))

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(run())
    return sent


def test_a_client_leaving_while_it_sends_its_body_is_not_a_server_error(server: Server) -> None:
    with Records("examples.server") as logged:
        sent = call_asgi(server.app, "POST", "/v1/chat/completions",
                         [(b"content-type", b"application/json"), (b"content-length", b"100")],
                         [{"type": "http.request", "body": b'{"messages":', "more_body": True},
                          {"type": "http.disconnect"}])
    assert not logged.records, [r.getMessage() for r in logged.records]
    assert sent[0]["status"] == 499  # client closed request: what the server would send to nobody


def test_a_server_error_is_a_500_logged_once(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.state.engine, "complete", broken)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    with Records("examples.server") as logged:
        # Starlette's last resort re-raises what it answered with a 500, for the server to log again.
        sent = call_asgi(server.app, "POST", "/v1/chat/completions", [(b"content-type", b"application/json")],
                         [{"type": "http.request", "body": body, "more_body": False}])
    assert sent[0]["status"] == 500
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["type"] == "server_error" and error["message"] == "internal server error"  # no details
    rid = dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert re.fullmatch(r"req_[0-9a-f]{32}", rid)
    # The client's report of its request id finds the log line.
    assert [r.getMessage() for r in logged.records] == [f"internal error serving POST /v1/chat/completions "
                                                        f"(request {rid})"]
    assert logged.records[0].exc_info is not None  # with its traceback


def test_every_response_names_its_request_id(server: Server) -> None:
    # OpenAI's x-request-id (its client's _request_id): one a proxy sent, where plain, else a new one.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ids = [httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).headers["x-request-id"]
           for _ in range(2)]
    ids += [httpx.get(f"{server.url}{path}", timeout=30).headers["x-request-id"] for path in ("/v1/models", "/nowhere")]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        ids.append(r.headers["x-request-id"])
        r.read()
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert refused.status_code == 400
    ids.append(refused.headers["x-request-id"])
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids), ids
    given = httpx.get(f"{server.url}/v1/models", headers={"X-Request-ID": "lb-7f3a.21:9"}, timeout=30)
    assert given.headers.get_list("x-request-id") == ["lb-7f3a.21:9"]
    # One that is no plain id (spaces, another header's text) is not echoed into a header or the log.
    odd = httpx.get(f"{server.url}/v1/models", headers={"X-Request-ID": "a b\tc" + "x" * 200}, timeout=30)
    assert re.fullmatch(r"req_[0-9a-f]{32}", odd.headers["x-request-id"])


def test_greedy_replies_equal_plain_transformers_from_every_tier(server: Server) -> None:
    model, tokenizer = build_model(server.settings)  # built anew from the same settings: same weights
    messages = conversation("exact")
    for turn in range(3):
        reply = server.chat(messages, key="k-exact", session="e", max_tokens=24)
        ids = torch.tensor([tokenizer.encode_chat((m["role"], m["content"]) for m in messages)])
        reference = model.generate(ids, max_new_tokens=24, do_sample=False,
                                   suppress_tokens=list(tokenizer.suppress_ids), eos_token_id=tokenizer.end_id,
                                   pad_token_id=tokenizer.end_id)
        generated = reference[0, ids.shape[1]:].tolist()
        assert text(reply) == tokenizer.decode(generated)
        assert reply["usage"]["prompt_tokens"] == ids.shape[1]
        assert reply["usage"]["completion_tokens"] == len(generated)
        if turn == 1:
            # Other tenants' sessions pushed this one out of memory (device 64 KiB + host 128 KiB,
            # ~80 KiB a session): it came back from disk.
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["disk"] > 0
        assert (cached(reply) > 0) == (turn > 0)
        messages = follow_up(messages, reply, f"Question {turn}?")
        if turn == 0:
            for i in range(3):
                server.chat(conversation(f"pusher {i}"), key=f"k-push-{i}", session="p", max_tokens=8)


def test_a_seed_makes_sampling_reproducible_and_replies_stay_printable(server: Server) -> None:
    messages = conversation("sampling")
    a, b = (text(server.chat(messages, key="k-sample", temperature=0.9, top_p=0.95, seed=7, max_tokens=32))
            for _ in range(2))
    assert a == b
    assert all(" " <= c <= "~" or c in "\t\n" for c in a)  # what round-trips through the byte tokenizer


def test_sampled_replies_are_plain_transformers_sampling_with_openai_s_defaults(server: Server) -> None:
    model, tokenizer = build_model(server.settings)
    messages = conversation("sampled")
    ids = torch.tensor([tokenizer.encode_chat((m["role"], m["content"]) for m in messages)])

    def reference(temperature: float, top_p: float, seed: int) -> str:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = model.generate(ids, max_new_tokens=16, do_sample=True, temperature=temperature, top_p=top_p,
                                 top_k=0, suppress_tokens=list(tokenizer.suppress_ids), eos_token_id=tokenizer.end_id,
                                 pad_token_id=tokenizer.end_id)  # top_k=0: OpenAI's API has no top-k
        return tokenizer.decode(out[0, ids.shape[1]:].tolist())

    rng = torch.random.get_rng_state()
    assert text(server.chat(messages, key="k-sampled", temperature=1.5, top_p=0.9, seed=11, max_tokens=16)) == \
        reference(1.5, 0.9, 11)
    # A seed is the request's own: the process's generator is left as it was, for the unseeded requests.
    assert torch.equal(torch.random.get_rng_state(), rng)
    # Without temperature and top_p: OpenAI's defaults, 1 and 1 (not greedy).
    r = server.post({"messages": messages, "seed": 5, "max_tokens": 16}, key="k-sampled")
    assert r.status_code == 200 and text(r.json()) == reference(1.0, 1.0, 5)
    assert r.json()["model"] == server.settings.model_name  # no model asked for: the one served
    # Building the model (at startup) does not reseed the process's generator either.
    torch.rand(1)  # off the state that building the model would seed
    rng = torch.random.get_rng_state()
    build_model(server.settings)
    assert torch.equal(torch.random.get_rng_state(), rng)


BIG = "x" * 1000  # 1000 tokens: over max_input_tokens=600, under max_body_bytes


@pytest.mark.parametrize("body, status, param, code", [
    (b'{"messages": [', 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_type"),
    (b"\xff\xfe", 400, None, "invalid_json"),
    ({"model": "m"}, 400, "messages", "missing_required_parameter"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": "hello"}, 400, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing_required_parameter"),
    # Parts other than text are named by their place and type (pydantic's "Input should be 'text'; or
    # Field required" named the content and said nothing of images), and a text part needs its text.
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]}, 400,
     "messages[0].content[1].type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "No."}]}]}, 400, "messages[1].content[0].type", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, 400, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, 400, "max_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, 400,
     "max_completion_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400, "seed", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": BIG}]}, 400, "messages", "context_length_exceeded"),
    # Fields OpenAI defines that this server cannot honour: refused by name, not ignored (helper-44).
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice",
     "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400, "functions",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}, 400, "modalities",
     "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "store": True}, 400, "store", "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}, 400, "reasoning_effort",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"264": 1}}, 400, "logit_bias",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"65": 101}}, 400, "logit_bias",
     "invalid_value"),
    # Another spelling of token 65: its bias was added to the first's (here: none left), past +-100.
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"65": 100, "065": -100}}, 400, "logit_bias",
     "invalid_value"),
    # Tokens generation never picks (a byte that is not printable ASCII, a special but <|end|>): a
    # positive bias on one was accepted and changed nothing, where OpenAI's +100 makes it the reply.
    *[({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"65": 1, token: 100}}, 400, "logit_bias",
       "invalid_value") for token in ("13", "195", "256", str(VOCAB_SIZE - 1))],
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"65": "1"}}, 400, "logit_bias",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": "x" * 100_000}]}, 413, None, "request_too_large"),
    # Fields of a message the chat template has no place for, and stream_options without a stream:
    # they were dropped without a word.
    ({"messages": [{"role": "user", "content": "hi", "name": "alice"}]}, 400, "messages[0].name",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "and?"}]}, 400, "messages[1].tool_calls", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                        "function_call": {"name": "f", "arguments": "{}"}}]},
     400, "messages[1].function_call", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                        "refusal": "I cannot help with that."}]},
     400, "messages[1].refusal", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "audio": {"id": "audio_1"}}]},
     400, "messages[1].audio", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": False, "stream_options": {}}, 400,
     "stream_options", "invalid_value"),
    # More fields this server cannot honour, and values out of OpenAI's ranges.
    *[({"messages": [{"role": "user", "content": "hi"}], field: value}, 400, field, code) for field, value, code in (
        ("logprobs", True, "unsupported_parameter"), ("tools", [{"type": "function"}], "unsupported_parameter"),
        ("function_call", {"name": "f"}, "unsupported_value"), ("audio", {"voice": "x"}, "unsupported_parameter"),
        ("verbosity", "high", "unsupported_value"), ("web_search_options", {}, "unsupported_parameter"),
        # Moderation was asked for and silently skipped: unmoderated replies reached the client.
        ("moderation", {"model": "omni-moderation-latest"}, "unsupported_parameter"),
        ("top_p", -0.1, "invalid_value"), ("temperature", -0.5, "invalid_value"), ("n", 0, "invalid_value"),
        ("frequency_penalty", 2.5, "invalid_value"), ("top_logprobs", 21, "invalid_value"),
        ("stop", "", "invalid_value"), ("stop", ["a", ""], "invalid_value"),
        ("logit_bias", {"65": -101}, "invalid_value"),
        ("max_tokens", "5", "invalid_type"))],
])
def test_bad_requests_get_openai_errors(server: Server, body: Any, status: int, param: str | None,
                                        code: str | None) -> None:
    raw = body if isinstance(body, bytes) else None
    r = server.post(body, key="k-bad", raw=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_a_body_sent_compressed_or_not_in_utf_8_is_told_so(server: Server) -> None:
    import gzip

    body = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}], "max_tokens": 1}, ensure_ascii=False)
    json_type = {"Content-Type": "application/json"}
    # Each was "not valid JSON (... expected value at line 1 column 1)" or "invalid unicode code point".
    for raw, status, words in ((body.encode("latin-1"), 400, "not UTF-8 text (byte "),
                               (body.encode("utf-16"), 400, "not UTF-8 text (byte 0"),
                               (gzip.compress(body.encode()), 415, "Content-Encoding: gzip")):
        headers = {**json_type, **({"Content-Encoding": "gzip"} if status == 415 else {})}
        r = server.post(None, raw=raw, key="k-bad", headers=headers)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    # A UTF-8 byte order mark (PowerShell's UTF-8 files begin with one) is read past, as RFC 8259 allows.
    r = server.post(None, raw=codecs.BOM_UTF8 + body.encode(), key="k-bad", headers=json_type)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2 + len("caf\u00e9".encode()) + 2, r.text
    # Malformed JSON sent as UTF-8 is still told where it breaks, "Content-Encoding: identity"
    # (no encoding) too.
    for encoding in ({}, {"Content-Encoding": "identity"}):
        r = server.post(None, raw=b'{"messages": [', key="k-bad", headers={**json_type, **encoding})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


def test_a_number_that_is_not_finite_is_refused_as_such(server: Server) -> None:
    # json.dumps(float("nan")) writes NaN: it was told "should be less than or equal to 2".
    for field in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias"):
        for literal in ("NaN", "Infinity", "-Infinity"):
            value = literal if field != "logit_bias" else '{"65": %s}' % literal
            raw = b'{"messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field.encode(), value.encode())
            r = server.post(None, raw=raw, key="k-bad", headers={"Content-Type": "application/json"})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == field and "finite number" in error["message"], r.text


def test_a_model_name_is_echoed_up_to_a_bound_not_a_body_s_worth_per_chunk(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    name = "m" * 256
    assert server.chat(messages, key="k-model", model=name, max_tokens=1)["model"] == name
    # One more: refused, not echoed in every chunk of a stream (a 4 MiB body streamed 2 GiB back).
    r = server.post({"messages": messages, "model": name + "m", "stream": True}, key="k-model")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "at most 256 characters" in r.json()["error"]["message"]


def test_a_request_with_several_faults_is_told_of_the_first_parameter_and_its_reasons_only(server: Server) -> None:
    r = server.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten", "temperature": 3},
                    key="k-bad")
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens" and error["message"].startswith("max_tokens: ")
    assert "less than or equal to 2" not in error["message"], error  # the temperature's reason


def test_each_limit_is_accepted_and_one_past_it_refused(server: Server) -> None:
    json_type = {"Content-Type": "application/json", "X-API-Key": "k-limits"}
    limit = server.settings.max_body_bytes
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    exact = body + b" " * (limit - len(body))
    for raw, status in ((exact, 200), (exact + b" ", 413)):
        assert server.post(None, raw=raw, headers=json_type).status_code == status
        # Without a declared length (chunked): counted as it arrives.
        r = httpx.post(f"{server.url}/v1/chat/completions", content=iter([raw[:1000], raw[1000:]]), headers=json_type,
                       timeout=60)
        assert "content-length" not in r.request.headers and r.status_code == status
    # A declared length over the limit is refused before any of the body comes.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % (limit + 1))
        assert client.recv(64).startswith(b"HTTP/1.1 413 ")
    # Prompt tokens: 2 + (bytes + 2) per message; "\u00e9" is two bytes.
    tokens = server.settings.max_input_tokens
    assert (tokens - 4) % 2 == 0
    fits = "\u00e9" * ((tokens - 4) // 2)
    r = server.post({"messages": [{"role": "user", "content": fits}], "max_tokens": 1}, key="k-limits")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tokens, r.text
    r = server.post({"messages": [{"role": "user", "content": fits + "x"}], "max_tokens": 1}, key="k-limits")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # Four stop strings, and the ends of logit_bias's ranges (+100 on a token that can be generated; a
    # zero bias, as neutral as none, on one that cannot).
    r = server.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stop": ["a", "b", "c", "d"],
                     "logit_bias": {"0": -100, "13": 0, str(VOCAB_SIZE - 1): -100, "126": 100}}, key="k-limits")
    assert r.status_code == 200 and text(r.json()) == "~", r.text


def test_neutral_values_of_the_fields_this_server_refuses_are_accepted(server: Server) -> None:
    messages = conversation("neutral")
    plain = text(server.chat(messages, key="k-neutral"))
    neutral = dict(frequency_penalty=0, presence_penalty=0.0, logit_bias={}, logprobs=False, top_logprobs=0,
                   tools=[], tool_choice="none", response_format={"type": "text"}, modalities=["text"], store=False,
                   verbosity="medium", n=1, parallel_tool_calls=False, metadata={"a": "b"}, service_tier="auto",
                   prediction={"type": "content", "content": "x"}, audio=None, functions=None, function_call="auto",
                   stream_options=None, stream=None,  # null: OpenAI's types are "boolean or null"
                   moderation=None, prompt_cache_key="k", prompt_cache_options={"ttl": "30m"},
                   prompt_cache_retention="24h", safety_identifier="u-1")
    assert text(server.chat(messages, key="k-neutral", **neutral)) == plain
    # A message's: what a client sends back of OpenAI's replies (refusal: null...), an empty name.
    history = [*messages, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More?"}]
    plain = text(server.chat(history, key="k-neutral"))
    neutral_history = [{**history[0], "name": ""}, {**history[1], "name": None},
                       {**history[2], "refusal": None, "tool_calls": [], "function_call": None, "audio": None},
                       history[3]]
    assert text(server.chat(neutral_history, key="k-neutral")) == plain
    # An assistant's content: null (OpenAI's, beside a tool call) is the empty text; text parts join as they are.
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    a, b = (server.chat([*messages, {"role": "assistant", "content": null}, {"role": "user", "content": content}],
                        key="k-neutral") for null, content in ((None, parts), ("", "Hello")))
    assert text(a) == text(b) and a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def openai_penalised_greedy(model: torch.nn.Module, tokenizer: Any, messages: list[dict[str, Any]], n: int,
                            frequency: float, presence: float, bias: dict[int, float]) -> str:
    """The greedy reply OpenAI's definition of the penalties and logit_bias gives, one full forward per
    token: logit[j] - count[j] * frequency - (count[j] > 0) * presence + bias[j]."""
    ids = tokenizer.encode_chat((m["role"], m["content"]) for m in messages)
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + generated])).logits[0, -1].float()
            logits[list(tokenizer.suppress_ids)] = float("-inf")
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - counts * frequency - (counts > 0).float() * presence
            for token, value in bias.items():
                logits[token] += value
            generated.append(int(logits.argmax()))
            if generated[-1] == tokenizer.end_id:
                break
    return tokenizer.decode(generated)


def test_frequency_and_presence_penalties_and_logit_bias_are_openai_s(server: Server) -> None:
    # They were accepted and ignored: the reply was the one without them (helper-44).
    model, tokenizer = build_model(server.settings)
    messages = conversation("penalties")
    plain = text(server.chat(messages, key="k-penalty", max_tokens=24))
    fields = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"101": 4, "32": -1.5})
    penalised = text(server.chat(messages, key="k-penalty", max_tokens=24, **fields))
    assert penalised != plain
    assert penalised == openai_penalised_greedy(model, tokenizer, messages, 24, 1.5, 0.5, {101: 4, 32: -1.5})
    # Streamed alike; and before temperature and top_p: after them, top_p would already have cut "Z" off.
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in server.stream(
        messages, key="k-penalty", max_tokens=24, **fields)[:-2]) == penalised
    sampled = text(server.chat(messages, key="k-penalty", temperature=2, top_p=0.05, seed=3, logit_bias={"90": 100}))
    assert sampled == "Z" * 8


def test_other_refusals_are_openai_errors_too(server: Server) -> None:
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    for r, status, code in ((httpx.get(f"{server.url}/v1/nowhere"), 404, "not_found"),
                            (httpx.get(f"{server.url}/v1/chat/completions"), 405, "method_not_allowed"),
                            (server.post(ok, headers={"Authorization": "Basic abc"}), 401, "invalid_api_key"),
                            (server.post(ok, headers={"Authorization": "Bearer"}), 401, "invalid_api_key")):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "invalid_request_error"
        if status == 405:
            assert r.headers["allow"] == "POST"  # what to use instead
    # Each says what to send instead, not Starlette's bare "Not Found" or "Method Not Allowed".
    nowhere = httpx.get(f"{server.url}/v1/nowhere").json()["error"]["message"]
    assert "POST /v1/chat/completions" in nowhere and "DELETE /v1/sessions/" in nowhere and "base URL" not in nowhere
    # An OpenAI client's base URL given without /v1: told so.
    for method, path in (("POST", "/chat/completions"), ("GET", "/models")):
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == 404 and "base URL ends in /v1" in r.json()["error"]["message"], r.text
    assert "send POST" in httpx.get(f"{server.url}/v1/chat/completions").json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/sessions/private-id")
    assert r.status_code == 405 and "send DELETE" in r.text and "private-id" not in r.text
    # A content part's type is named, up to a length: the input is not echoed in bulk.
    for kind, told in (("input_audio", '"input_audio"'), ("x" * 5000, "too long to repeat")):
        r = server.post({"messages": [{"role": "user", "content": [{"type": kind}]}]})
        assert r.status_code == 400 and told in r.json()["error"]["message"] and len(r.text) < 500, r.text
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"  # and the server is still well


def test_healthz_models_and_metrics(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    # A load balancer's HEAD probe was a 405; the 404's list of routes still names each GET once.
    for path in ("/healthz", "/v1/models", f"/v1/models/{server.settings.model_name}", "/metrics"):
        r = httpx.head(f"{server.url}{path}")
        assert r.status_code == 200 and r.content == b"", path
    assert "HEAD" not in httpx.get(f"{server.url}/v1/nowhere").json()["error"]["message"]
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == server.settings.model_name
    # OpenAI's retrieve (client.models.retrieve): it was a 404 for the served model too.
    assert httpx.get(f"{server.url}/v1/models/{server.settings.model_name}").json() == models["data"][0]
    other = httpx.get(f"{server.url}/v1/models/org/other-model")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    messages = conversation("metrics")
    first = server.chat(messages, key="k-metrics", session="m")
    assert cached(server.chat(follow_up(messages, first, "Again?"), key="k-metrics", session="m")) > 0

    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    hits = {s.labels["tier"]: s.value for s in families["tierkv_hit_tokens"].samples
            if s.name == "tierkv_hit_tokens_total"}
    assert set(hits) == {"device", "host", "disk"} and sum(hits.values()) > 0
    assert "tierkv_tier_bytes" in families and "tierkv_open_duration_seconds" in families


# The official client, as a user of the README's server runs it. Its reply models are built without
# validation (a field of the wrong type would only show in the user's code), so each body is also
# validated against them here.
NO_OPENAI = "the official openai client is not installed (pip install -e '.[test]' installs it)"


def test_the_openai_client_parses_every_reply_stream_model_and_error(server: Server) -> None:
    openai = pytest.importorskip("openai", reason=NO_OPENAI)
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k-openai", max_retries=0, timeout=60)
    messages: list[Any] = conversation("openai client")
    session = {"X-Session-ID": "openai-chat"}
    raw = client.chat.completions.with_raw_response.create(model="test-model", messages=messages, max_tokens=6,
                                                           temperature=0, extra_headers=session)
    assert raw.headers["content-type"] == "application/json"
    first = raw.parse()
    ChatCompletion.model_validate(json.loads(raw.text), strict=True)
    assert first._request_id == raw.headers["x-request-id"] and first._request_id.startswith("req_")
    assert first.object == "chat.completion" and first.model == "test-model" and first.id.startswith("chatcmpl-")
    assert abs(first.created - time.time()) < 3600 and first.system_fingerprint == server.state.fingerprint
    assert first.choices[0].finish_reason in ("stop", "length") and first.choices[0].logprobs is None
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The next turn as such a client sends it: the reply object itself appended to the history.
    messages += [first.choices[0].message, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="test-model", messages=messages, max_completion_tokens=6,
                                            temperature=0, extra_headers=session)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
    # Streamed, with usage: the same reply, chunk by chunk; stop and seed as the request gave them.
    fields: dict[str, Any] = dict(model="test-model", messages=messages, max_tokens=12, temperature=0.7, seed=7,
                                  stop=["\n\n"], extra_body={"user": "openai-chat"})
    whole = client.chat.completions.create(**fields)
    with client.chat.completions.with_streaming_response.create(stream=True, stream_options={"include_usage": True},
                                                                **fields) as streamed:
        lines = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: {")]
    chunks = [ChatCompletionChunk.model_validate(json.loads(line), strict=True) for line in lines]
    parsed = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **fields))
    assert [(c.choices and c.choices[0].delta.content, c.usage) for c in parsed] == [
        (c.choices and c.choices[0].delta.content, c.usage) for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason
    # Models: listed, retrieved, another one a NotFoundError.
    listed = client.models.list()
    assert [m.id for m in listed.data] == [server.settings.model_name]
    Model.model_validate(client.models.retrieve(server.settings.model_name).model_dump(), strict=True)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and "GET /v1/models lists it" in missing.value.message
    # Refusals arrive as the client's typed errors, carrying the server's own words and param.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="test-model", messages=messages, n=2)
    assert refused.value.param == "n" and "send n requests instead" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="test-model", messages=messages, logprobs=True, top_logprobs=2)
    assert refused.value.param == "logprobs" and refused.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="test-model", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert refused.value.param == "messages[0].content[0].type" and '"image_url"' in refused.value.message
    # A base URL without /v1 is told so.
    bare = openai.OpenAI(base_url=server.url, api_key="k-openai", max_retries=0)
    with pytest.raises(openai.NotFoundError) as lost:
        bare.chat.completions.create(model="test-model", messages=messages)
    assert "base URL ends in /v1" in lost.value.message


def test_replies_carry_the_fields_openai_s_current_api_always_sends(server: Server) -> None:
    # Optional in OpenAI's types, always in its replies: usage.completion_tokens_details was left out,
    # so a client reading its reasoning_tokens (as usage trackers do) failed on None; likewise a
    # message's refusal and annotations, and the reply's service_tier.
    openai = pytest.importorskip("openai", reason=NO_OPENAI)
    none = {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    messages = conversation("current fields")
    reply = server.chat(messages, key="k-fields", session="fields", service_tier="auto")
    assert reply["service_tier"] == "default"  # the tier that served it, as OpenAI answers "auto"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": text(reply), "refusal": None,
                                              "annotations": []}
    assert reply["usage"]["completion_tokens_details"] == none
    details = reply["usage"]["prompt_tokens_details"]
    assert sorted(details) == ["audio_tokens", "cached_tokens", "cached_tokens_by_tier"]
    assert details["audio_tokens"] == 0
    # The message sent back as it came (refusal null, annotations []) is accepted and restores the turn.
    again = server.chat(follow_up(messages, reply, "More?"), key="k-fields", session="fields")
    assert cached(again) == reply["usage"]["total_tokens"] - 1
    streamed = server.stream(messages, key="k-fields-stream")
    assert [p["service_tier"] for p in streamed[:-1]] == ["default"] * (len(streamed) - 1)
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert streamed[-2]["usage"]["completion_tokens_details"] == none
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k-fields-openai", max_retries=0, timeout=60)
    typed = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert typed.usage is not None and typed.usage.completion_tokens_details is not None
    assert typed.usage.completion_tokens_details.reasoning_tokens == 0 and typed.service_tier == "default"
    assert typed.choices[0].message.refusal is None and typed.choices[0].message.annotations == []


def test_the_openai_client_waits_the_retry_after_of_a_full_queue_then_is_served(busy: Server) -> None:
    openai = pytest.importorskip("openai", reason=NO_OPENAI)
    gate = threading.Event()
    refused_at: list[float] = []
    sent_at: list[float] = []
    told: list[int] = []

    def on_response(response: Any) -> None:
        if response.status_code == 429:
            gate.set()  # the queue drains before the client, whose thread this is, goes on
            wait_for_pending(busy, 0, "the queued turns never ran")
            refused_at.append(time.monotonic())
            told.append(int(response.headers["retry-after-ms"]))

    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda _: sent_at.append(time.monotonic())],
                                                  "response": [on_response]})
    client = openai.OpenAI(base_url=f"{busy.url}/v1", api_key="k-openai-429", max_retries=1, timeout=60,
                           http_client=http)
    queued_client = openai.OpenAI(base_url=f"{busy.url}/v1", api_key="k-openai-429", max_retries=0, timeout=60)
    messages = conversation("openai retry")
    held = busy.state.engine.submit(gate.wait)
    pool = concurrent.futures.ThreadPoolExecutor(3)
    measured = busy.state.engine.turn_seconds
    try:
        queued = [pool.submit(queued_client.chat.completions.create, model="m", max_tokens=2, temperature=0,
                              messages=[{"role": "user", "content": f"{i} waits in the queue."}]) for i in range(3)]
        wait_for_pending(busy, 3, "the three turns the queue holds were never queued")
        busy.state.engine.turn_seconds = None  # Retry-After: 1 s, spread: 1 to 2 s
        served = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=4,
                                                                  temperature=0)
        assert [f.result(timeout=60).choices[0].finish_reason in ("stop", "length") for f in queued] == [True] * 3
    finally:
        gate.set()
        held.result(timeout=60)
        pool.shutdown()
        busy.state.engine.turn_seconds = measured
    assert served.retries_taken == 1 and served.parse().choices[0].message.content == text(
        busy.chat(messages, key="k-openai-alone", max_tokens=4))
    # It slept the server's retry-after-ms (1 to 2 s), not its own first backoff (at most 0.5 s).
    assert len(refused_at) == 1 and len(sent_at) == 2 and 1000 <= told[0] < 2000
    assert sent_at[1] - refused_at[0] >= told[0] / 1000 - 0.05


def test_settings_come_from_the_environment_then_the_flags() -> None:
    from examples.server.settings import parse_args

    env = {"TIERKV_STORE": "none", "TIERKV_BLOCK_SIZE": "16", "TIERKV_PORT": "9000"}
    assert Settings.from_env(env).store is None and Settings.from_env(env).block_size == 16
    assert parse_args(["--block-size", "32"], env).block_size == 32 and parse_args([], env).port == 9000
    with pytest.raises(ValueError, match="TIERKV_BLOCK_SIZE"):
        Settings.from_env({"TIERKV_BLOCK_SIZE": "big"})
    # "none" in any case, or empty: no disk tier; an empty device: auto.
    assert Settings.from_env({"TIERKV_STORE": " None "}).store is None
    assert Settings.from_env({"TIERKV_STORE": "none", "TIERKV_DEVICE": ""}).device is None
    # The limits' own ends are accepted.
    from examples.server.settings import MAX_POSITIONS

    assert Settings(store=None, max_input_tokens=MAX_POSITIONS - 512, max_output_tokens=512, default_max_tokens=512,
                    port=0, block_size=1).max_input_tokens == MAX_POSITIONS - 512


def test_help_tells_each_flags_default_and_the_hidden_sizes_the_server_takes(
        capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    from examples.server.settings import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"], {})
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for field in dataclasses.fields(Settings):
        shown = ("auto" if field.name == "device" else "none") if field.default is None else field.default
        assert f"(default: {shown}) [$TIERKV_{field.name.upper()}]" in text, field.name
    # It said "a multiple of 64", and 320 is one that the settings refuse.
    assert "hidden size of the tiny model: 64, 128, 192 or a multiple of 128" in text
    for hidden in range(64, 1025, 64):
        named = hidden in (64, 128, 192) or hidden % 128 == 0
        try:
            Settings(store=None, tiny_hidden=hidden)
        except ValueError:
            assert not named, hidden
        else:
            assert named, hidden


@pytest.mark.parametrize(("flags", "message"), [
    (["--device-budget", "10%"], "cannot read device_budget='10%' as a byte count"),
    (["--host-budget", "1.5"], "host_budget='1.5' is a fraction of a byte; give a unit"),
    (["--tiny-hidden", "100"], "tiny_hidden must be 64, 128, 192 or a multiple of 128"),
    (["--tiny-hidden", "320"], "tiny_hidden must be 64, 128, 192 or a multiple of 128"),
    (["--max-input-tokens", "8000"], "max_input_tokens + max_output_tokens must be <= 8192"),
    (["--port", "70000"], "port must be in 0..65535"),
    (["--port", "-1"], "port must be in 0..65535"),
    (["--block-size", "0"], "block_size must be >= 1, got 0"),
    (["--block-size", str(2**20 + 1)], "block_size must be <= 1048576 tokens"),  # the store's limit, found at startup
    # The id /v1/models lists, which clients send back: empty (TIERKV_MODEL_NAME= in an env file) or one
    # a request may not name (past 256 characters) was served.
    (["--model-name", ""], "model_name must be 1 to 256 characters"),
    (["--model-name", " tierkv"], "model_name must be 1 to 256 characters"),
    (["--model-name", "m" * 257], "model_name must be 1 to 256 characters"),
    (["--default-max-tokens", "600"], "default_max_tokens (600) must not exceed max_output_tokens (512)"),
    (["--max-pending-turns", "0"], "max_pending_turns must be >= 1, got 0"),
    (["--sse-keep-alive", "0"], "sse_keep_alive must be more than 0 and at most 3600 seconds"),
    (["--sse-keep-alive", "nan"], "sse_keep_alive must be more than 0 and at most 3600 seconds"),
    (["--timeout-graceful-shutdown", "-1"], "timeout_graceful_shutdown must be 0 or more seconds, or none"),
    (["--timeout-graceful-shutdown", "inf"], "timeout_graceful_shutdown must be 0 or more seconds, or none"),
    (["--seed", str(2**64)], "seed must be in -9223372036854775808..18446744073709551615"),
    (["--seed", str(-(2**63) - 1)], "seed must be in -9223372036854775808..18446744073709551615"),
    (["--store", __file__], "is a file; give a directory"),
    (["--model", "meta-llama/Llama-3-8B"], "serves the built-in random model only"),
    (["--host", ""], "host is empty, which would listen on every interface; pass --host 0.0.0.0"),
    (["--device", "gpu"], "device='gpu' is not a device"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_bad_server_settings_are_usage_errors_before_the_server_starts(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from examples.server.settings import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(flags, {})
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("device", ["gpu", "cpu:x"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_a_bad_device_is_refused_with_the_flags_to_pass(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    from examples.server.settings import parse_args

    # The library's message advised device=None, which no flag or variable can say.
    with pytest.raises(SystemExit):
        parse_args(["--device", device], {})
    err = capsys.readouterr().err
    assert "pass --device cpu, cuda or cuda:N, or leave --device (TIERKV_DEVICE) unset" in err
    assert "None" not in err


def test_python_m_examples_server_hands_its_graceful_shutdown_timeout_to_uvicorn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM waited for every queued turn, and no flag could bound the wait (uvicorn's own
    # --timeout-graceful-shutdown is not python -m examples.server's).
    import examples.server.app
    from examples.server.__main__ import main

    ran: list[dict[str, Any]] = []
    monkeypatch.setattr(examples.server.app, "create_app", lambda settings: settings)  # no model, no store
    monkeypatch.setattr(uvicorn, "run", lambda app, **config: ran.append(config))
    monkeypatch.delenv("TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN", raising=False)
    main(["--store", "none", "--port", "0"])
    monkeypatch.setenv("TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN", "2.5")
    main(["--store", "none", "--port", "0"])
    main(["--store", "none", "--port", "0", "--timeout-graceful-shutdown", "none"])
    main(["--store", "none", "--port", "0", "--timeout-graceful-shutdown", "0"])
    assert [config["timeout_graceful_shutdown"] for config in ran] == [None, 2.5, None, 0.0]


def test_the_system_fingerprint_names_what_decides_the_replies(server: Server) -> None:
    from examples.server.app import fingerprint

    messages = conversation("fingerprint")
    assert server.chat(messages, key="k-fp")["system_fingerprint"] == server.state.fingerprint
    assert {c["system_fingerprint"] for c in server.stream(messages, key="k-fp") if c != "[DONE]"} == \
        {server.state.fingerprint}
    # It was one constant for every server: other weights (a seed, a shape) or a device kind gave
    # the same one, so a client comparing seeded replies could not tell they may differ.
    cpu, settings = torch.device("cpu"), replace(server.settings, store=None)  # the store is open here
    assert fingerprint(settings, cpu) == server.state.fingerprint == fingerprint(server.settings, cpu)
    others = {fingerprint(replace(settings, seed=1), cpu), fingerprint(replace(settings, tiny_layers=3), cpu),
              fingerprint(replace(settings, tiny_hidden=128), cpu), fingerprint(settings, torch.device("cuda"))}
    assert len(others) == 4 and server.state.fingerprint not in others


def test_the_system_fingerprint_tells_apart_machines_whose_kernels_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the device's type alone, so an H100's server and an A100's (or an AVX2 and an AVX512
    # CPU's) gave one fingerprint, while their kernels round otherwise (tierkv keys its own stores
    # on the GPU model and the CPU's vector code for that) and a seed may draw other replies.
    from examples.server.app import fingerprint

    settings = Settings(store=None)
    seen = set()
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        seen.add(fingerprint(settings, torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        seen.add(fingerprint(settings, torch.device("cuda", 0)))
    assert len(seen) == 4


def test_unseeded_sampling_does_not_repeat_the_last_run_after_a_restart() -> None:
    # torch seeds its generator with one constant at import, so each restarted server drew the same
    # "random" replies to unseeded requests as the last one did.
    seeds = []
    for _ in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a process that just imported torch, each time
            state = ServerState.start(Settings(store=None, **SMALL))
            state.close()
            seeds.append(torch.initial_seed())
    assert seeds[0] != seeds[1] and 0 not in seeds


def test_every_seed_torch_takes_is_a_valid_setting() -> None:
    for seed in (-(2**63), 2**64 - 1):  # the bounds refused one beyond, above
        assert Settings(store=None, seed=seed).seed == seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # as build_model seeds the weights


def test_an_empty_host_is_refused_rather_than_read_as_every_interface() -> None:
    from examples.server.settings import parse_args

    # TIERKV_HOST= left empty in an env file: uvicorn would listen on every interface, without any key check.
    with pytest.raises(ValueError, match=r"host is empty.*pass --host 0\.0\.0\.0"):
        Settings.from_env({"TIERKV_HOST": ""})
    assert parse_args(["--host", "0.0.0.0"], {"TIERKV_HOST": ""}).host == "0.0.0.0"  # everywhere, asked by name


def test_a_host_or_port_the_server_cannot_listen_on_is_refused_before_the_model_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # uvicorn binds only after the lifespan's startup: the model loaded and the store opened first, and
    # then uvicorn logged a bare "[Errno -2] Name or service not known" and exited (helper-44).
    from examples.server.__main__ import main

    def loads_the_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn, "run", loads_the_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, message in ((["--host", "no-such-host.invalid"], "the host does not resolve"),
                               (["--host", "127.0.0.1:8000"], "give the port with --port, not in --host"),
                               (["--port", str(port)], f"cannot listen on --host '127.0.0.1' --port {port}")):
            with pytest.raises(SystemExit) as exc:
                main(["--store", "none", *flags])
            assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(AssertionError, match="the server started"):
        main(["--store", "none", "--port", "0"])  # what can be listened on passes


def test_a_store_made_with_another_block_size_is_refused_before_the_server_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from examples.server.settings import parse_args

    TieredStore(tmp_path / "kv", device="cpu", block_size=16).close()
    with pytest.raises(SystemExit) as exc:
        parse_args(["--store", str(tmp_path / "kv")], {})  # the default block size, 64
    assert exc.value.code == 2
    assert "was created with block_size=16; pass --block-size 16" in capsys.readouterr().err
    assert parse_args(["--store", str(tmp_path / "kv")], {"TIERKV_BLOCK_SIZE": "16"}).block_size == 16


def test_another_program_s_lmdb_environment_is_refused_before_the_server_starts_writing_nothing_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The block-size check read the directory through a read-only LMDB environment, which made
    # lock.mdb there (or wrote its reader table into the one there) before refusing it.
    from examples.server.settings import parse_args

    theirs = tmp_path / "theirs"
    env = lmdb.open(str(theirs), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"mydata", txn=txn))
    env.close()
    (theirs / "lock.mdb").unlink()  # copied without it: the check made one
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    with pytest.raises(SystemExit) as exc:
        parse_args(["--store", str(theirs)], {})
    assert exc.value.code == 2
    assert "holds an LMDB environment that is not a tierkv store" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before


@pytest.mark.parametrize(("link", "target", "message"), [
    ("lock.mdb", "their.lock", "LMDB's lock file must be a plain file"),
    ("data.mdb", "missing.mdb", "Its target does not exist"),
    ("tierkv.lock", "their.pid", "a store's lock file must be a plain file"),
])
def test_a_new_store_directory_holding_a_link_is_refused_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], link: str, target: str,
        message: str) -> None:
    # Before: only a store with a data.mdb was read before the model loaded (its block size); a
    # directory without one was taken for a new store, and the store's open refused the link at
    # startup, after the model loaded.
    from examples.server.__main__ import main

    def loads_the_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn, "run", loads_the_model)
    store = tmp_path / "kv"
    store.mkdir()
    if target != "missing.mdb":
        (tmp_path / target).write_bytes(b"another program's")
    (store / link).symlink_to(tmp_path / target)

    def files() -> dict[str, object]:  # what is there, links as their targets: the missing one not made
        return {str(p): os.readlink(p) if p.is_symlink() else p.read_bytes()
                for p in [*tmp_path.iterdir(), *store.iterdir()] if not p.is_dir() or p.is_symlink()}

    before = files()
    with pytest.raises(SystemExit) as exc:
        main(["--store", str(store), "--port", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{store / link}' is a symbolic link" in err and message in err, err
    assert files() == before


def test_a_store_in_use_stops_the_startup_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    settings = Settings(store=str(tmp_path / "kv"), **SMALL)  # checked before the store exists, as a server does
    holder = TieredStore(tmp_path / "kv", device="cpu", block_size=SMALL["block_size"])
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        uv = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="info", lifespan="on"))
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        errors = logging.getLogger("uvicorn.error")  # after Config, which replaces uvicorn's handlers
        errors.addHandler(handler)
        statuses: list[object] = []

        def run() -> None:
            try:
                uv.run(sockets=[sock])
            except SystemExit as exc:  # uvicorn's exit status for a failed startup
                statuses.append(exc.code)

        try:
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(60)
        finally:
            errors.removeHandler(handler)
            sock.close()
        assert not thread.is_alive() and not uv.started and statuses == [3]
    finally:
        holder.close()
    logged = [(r.levelno, r.getMessage()) for r in records if r.levelno >= logging.ERROR]
    assert len(logged) == 2 and all(r.exc_info is None for r in records), logged
    assert logged[0][1].startswith("the server cannot start: ") and "is in use by another TieredStore" in logged[0][1]
    assert "\n" not in logged[0][1] and "Traceback" not in logged[0][1]
    assert logged[1][1] == "Application startup failed. Exiting."


def test_the_app_for_uvicorn_is_made_from_the_environment_on_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient
    from uvicorn.importer import import_from_string

    import examples.server.app as module

    monkeypatch.delattr(module, "app", raising=False)  # made by an earlier use, if any
    try:
        monkeypatch.setenv("TIERKV_STORE", __file__)  # refused at the first use, not at the import
        with pytest.raises(ValueError, match="is a file"):
            import_from_string("examples.server.app:app")
        monkeypatch.setenv("TIERKV_STORE", "none")
        monkeypatch.setenv("TIERKV_MODEL_NAME", "from-the-environment")
        app = import_from_string("examples.server.app:app")  # as `uvicorn examples.server.app:app` finds it
        assert module.app is app  # made once
        # Without `with`, TestClient runs no lifespan: nothing is opened.
        assert TestClient(app).get("/v1/models").json()["data"][0]["id"] == "from-the-environment"
        with pytest.raises(AttributeError, match="no attribute 'apps'"):
            module.apps  # noqa: B018
    finally:
        vars(module).pop("app", None)


def test_the_app_for_uvicorn_warns_that_tierkv_host_and_port_are_not_its_to_read(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # uvicorn listens where its own --host and --port say: TIERKV_PORT=9000 was served on 8000
    # without a word. (Nor can the app check uvicorn's address before its startup: see __getattr__.)
    from uvicorn.importer import import_from_string

    import examples.server.app as module

    monkeypatch.delattr(module, "app", raising=False)
    monkeypatch.setenv("TIERKV_STORE", "none")
    for env in ("TIERKV_HOST", "TIERKV_PORT", "TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN"):
        monkeypatch.delenv(env, raising=False)
    try:
        for env, expected in ((None, None), ("TIERKV_PORT", "TIERKV_PORT set, but only `python -m examples.server` "
                                                            "reads it"),
                              ("TIERKV_HOST", "TIERKV_HOST and TIERKV_PORT set, but only `python -m examples.server` "
                                              "reads them")):
            if env is not None:
                monkeypatch.setenv(env, "9000" if env == "TIERKV_PORT" else "127.0.0.1")
            vars(module).pop("app", None)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="examples.server"):
                import_from_string("examples.server.app:app")
            warned = [r.getMessage() for r in caplog.records if r.name == "examples.server"]
            if expected is None:
                assert warned == []
            else:
                assert len(warned) == 1 and warned[0].startswith(expected) and "uvicorn: --host, --port" in warned[0]
        # Nor does the app read its graceful shutdown's timeout: uvicorn does, from its own flag.
        monkeypatch.delenv("TIERKV_HOST")
        monkeypatch.delenv("TIERKV_PORT")
        monkeypatch.setenv("TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN", "5")
        vars(module).pop("app", None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="examples.server"):
            import_from_string("examples.server.app:app")
        warned = [r.getMessage() for r in caplog.records if r.name == "examples.server"]
        assert warned == ["TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN set, but only `python -m examples.server` reads it: a "
                          "server importing examples.server.app:app shuts down as its own flags say (uvicorn: "
                          "--timeout-graceful-shutdown)"]
    finally:
        vars(module).pop("app", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_examples_server_serves_and_closes_its_store_on_shutdown(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    port = free_port()
    # TIERKV_STORE alone is refused (a file); the flag overrides it, and importing the app must not object.
    env = {**os.environ, "TIERKV_BLOCK_SIZE": "8", "TIERKV_TINY_LAYERS": "1", "TIERKV_TINY_HIDDEN": "64",
           "TIERKV_STORE": __file__}
    proc = subprocess.Popen([sys.executable, "-m", "examples.server", "--port", str(port), "--store", str(store)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": conversation("subprocess"), "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown: the lifespan closes the store
        output = proc.communicate(timeout=60)[0]
    # uvicorn re-raises the signal once it has shut down gracefully, so SIGTERM's status is a clean exit.
    assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in output, output[-3000:]
    # The server's own startup line, among uvicorn's: it was dropped (uvicorn configures its loggers only).
    assert re.search(rf"INFO: +serving tierkv-tiny \(tiny\) on (cpu|cuda:\d+); store {re.escape(str(store))}\n",
                     output), output[-3000:]
    # Closed means unlocked and flushed: this process can open the store and finds the turn's blocks.
    with TieredStore(store, block_size=8) as reopened:
        assert reopened.stats()["disk"]["blocks"] > 0


def test_close_ends_the_queued_turns_with_server_closing() -> None:
    # A queued stream waited forever for an end its dropped job never sent, and a queued
    # complete() raised a bare CancelledError (helper-37); the app answers 503 to the latter.
    import asyncio

    from examples.server.app import _sse
    from examples.server.engine import Engine, ServerClosing, Turn

    model, tokenizer = build_model(Settings(store=None, **SMALL))
    gate = threading.Event()

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        with TieredStore(None, device="cpu", block_size=8) as store:
            engine = Engine(model, tokenizer, store)
            engine.submit(gate.wait)  # the running turn
            ids = tokenizer.encode_chat([("user", "hi")])

            async def consume() -> None:
                async for _ in engine.stream(Turn(ids=ids, session="x", tenant=None, max_tokens=4)):
                    pass

            events: list[str] = []

            async def served() -> None:  # the app's stream of the same: an error event, not a cut
                async for event in _sse(engine, Turn(ids=ids, session="z", tenant=None, max_tokens=4),
                                        "c", 0, "m", "fp", False, 3600.0, engine.admit()):
                    events.append(event)

            streamed = asyncio.ensure_future(consume())
            plain = asyncio.ensure_future(engine.complete(Turn(ids=ids, session="y", tenant=None, max_tokens=4)))
            sse = asyncio.ensure_future(served())
            # A DELETE's forget, queued too: it raised a bare CancelledError, which the app answers with a 500.
            forget = asyncio.ensure_future(engine.call(store.forget, session="x", tenant=None))
            await asyncio.sleep(0.1)
            closing = asyncio.ensure_future(asyncio.to_thread(engine.close))
            await asyncio.sleep(0.1)
            gate.set()
            await closing
            done, _ = await asyncio.wait((streamed, plain, sse, forget), timeout=5)
            assert len(done) == 4, "a queued turn never ended after Engine.close()"
            assert sse.exception() is None and "shutting down" in events[-1] and '"error"' in events[-1]
            assert not forget.cancelled() and isinstance(forget.exception(), ServerClosing)
            return streamed.exception(), plain.exception()

    try:
        streamed, plain = asyncio.run(scenario())
    finally:
        gate.set()
    assert isinstance(streamed, ServerClosing) and isinstance(plain, ServerClosing)


def test_shutdown_lets_the_running_turn_commit_before_the_store_closes(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    state = ServerState.start(Settings(store=str(tmp_path / "kv"), **SMALL))
    engine = state.engine
    running, release = hold_after_first_token(engine.model, monkeypatch)
    from examples.server.engine import Turn

    ids = engine.tokenizer.encode_chat([("user", "the turn running at shutdown")])
    turn = engine.submit(engine._run, Turn(ids=ids, session="s", tenant=None, max_tokens=4), None, None)
    closer = threading.Thread(target=state.close)
    try:
        assert running.wait(30), "the turn never started"
        closer.start()
        deadline = time.monotonic() + 30
        while not engine._closing:  # the engine's close began: a store closed before it is closed by now
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        release.set()
        closer.join(60)
    assert turn.result(timeout=0).completion_tokens == 4
    with TieredStore(tmp_path / "kv", block_size=SMALL["block_size"]) as reopened:
        assert reopened.stats()["disk"]["blocks"] > 0  # the turn's commit reached the disk before the close


def test_a_startup_that_fails_after_the_store_opened_closes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import examples.server.app as module

    def broken(settings: Settings) -> Any:
        raise ValueError("no model")

    monkeypatch.setattr(module, "build_model", broken)
    with pytest.raises(ValueError, match="no model") as refused:
        ServerState.start(Settings(store=str(tmp_path / "kv"), **SMALL))
    # While the caller still holds the exception (its traceback holds the store): not "in use by another TieredStore".
    TieredStore(tmp_path / "kv", block_size=SMALL["block_size"]).close()
    del refused


def test_requests_the_graceful_shutdown_cancels_get_a_503_without_a_traceback() -> None:
    # uvicorn --timeout-graceful-shutdown: once it runs out, uvicorn cancels the requests still
    # running, and logged the CancelledError the app let out with a traceback, then sent a bare
    # 500 ("Internal Server Error") or cut a stream short (helper-44).
    app = create_app(Settings(store=None, **SMALL))
    uv, thread, sock, url = start_uvicorn(app, "test-uvicorn-shutdown", timeout_graceful_shutdown=0.5)
    gate = threading.Event()
    app.state.server.engine.submit(gate.wait)  # the running turn: both requests stay queued
    body = {"messages": conversation("cancelled"), "temperature": 0, "max_tokens": 8}

    def plain() -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)

    def streamed() -> tuple[int, list[str]]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            return r.status_code, [line for line in r.iter_lines() if line]  # raises if the stream is cut

    try:
        with Records("examples.server", "uvicorn.error") as logged, concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = pool.submit(plain), pool.submit(streamed)
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/healthz", timeout=5).json()["pending_turns"] != 2:
                assert time.monotonic() < deadline, "the turns were never queued"
                time.sleep(0.02)
            uv.should_exit = True
            response, (status, lines) = answers[0].result(timeout=30), answers[1].result(timeout=30)
    finally:
        gate.set()
        thread.join(60)
        sock.close()
    assert not thread.is_alive()
    assert response.status_code == 503, response.text
    assert response.json()["error"] == {"message": "the server is shutting down; retry the request",
                                        "type": "server_error", "param": None, "code": None}
    # When to come back (it said nothing, as a 429 does): soon, another server takes it behind a balancer.
    assert 1000 <= int(response.headers["retry-after-ms"]) < 2000 and response.headers["retry-after"] in ("1", "2")
    # The stream: its role chunk, then the error event, then its end (no [DONE]: the turn did not finish).
    assert status == 200 and len(lines) == 2, lines
    assert json.loads(lines[1][len("data: "):]) == response.json()
    problems = [m for m in (r.getMessage() for r in logged.records)
                if not (m.startswith("Cancel ") and "timeout graceful shutdown exceeded" in m)]  # uvicorn's own line
    assert not problems and all(r.exc_info is None for r in logged.records), problems
    assert app.state.server.engine.pending == 0


def test_a_cancelled_error_the_request_was_not_asked_for_is_a_500_and_a_double_cancel_goes_on(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise asyncio.CancelledError()  # as awaiting a future someone else cancelled does: a bug

    monkeypatch.setattr(server.state.engine, "complete", broken)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    request = [{"type": "http.request", "body": body, "more_body": False}]
    with Records("examples.server") as logged:
        sent = call_asgi(server.app, "POST", "/v1/chat/completions", [(b"content-type", b"application/json")],
                         list(request))
    rid = dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert sent[0]["status"] == 500 and [r.getMessage() for r in logged.records] == [
        f"internal error serving POST /v1/chat/completions (request {rid})"]

    async def hang(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()

    monkeypatch.setattr(server.state.engine, "complete", hang)

    async def cancelled_twice() -> None:
        pending = list(request)

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop(0)
            await asyncio.Event().wait()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            pass

        task = asyncio.ensure_future(server.app({**ASGI_SCOPE, "headers": [], "method": "POST",
                                                 "path": "/v1/chat/completions",
                                                 "raw_path": b"/v1/chat/completions"}, receive, send))
        await asyncio.sleep(0.1)
        task.cancel()
        task.cancel()  # two parties want it ended: it must end cancelled, not answered
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_twice())


def test_requests_after_the_engine_closed_get_a_503_and_hold_no_place_in_the_queue() -> None:
    # Engine.submit raised the executor's RuntimeError once closed: a 500 for every route, and
    # stream() had counted the turn before the submit that raised, so pending_turns never came
    # back down (helper-44).
    import asyncio

    from examples.server.engine import ServerClosing, Turn

    state = ServerState.start(Settings(store=None, **SMALL))
    app = create_app(state.settings)
    app.state.server = state
    try:
        state.engine.close()
        with pytest.raises(ServerClosing):
            state.engine.submit(print)
        turn = Turn(ids=state.engine.tokenizer.encode_chat([("user", "hi")]), session=None, tenant=None, max_tokens=4)

        async def consume() -> None:
            async for _ in state.engine.stream(turn):
                pass

        with pytest.raises(ServerClosing):
            asyncio.run(consume())
        assert state.engine.pending == 0
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        json_type = [(b"content-type", b"application/json")]
        for method, path, payload in (("POST", "/v1/chat/completions", body),
                                      ("POST", "/v1/chat/completions", {**body, "stream": True}),
                                      ("DELETE", "/v1/sessions/s", None)):
            raw = b"" if payload is None else json.dumps(payload).encode()
            with Records("examples.server") as logged:
                sent = call_asgi(app, method, path, json_type, [{"type": "http.request", "body": raw, "more_body": False}])
            assert not logged.records, [r.getMessage() for r in logged.records]
            content = b"".join(m.get("body", b"") for m in sent[1:])
            if payload is not None and payload.get("stream"):
                assert sent[0]["status"] == 200 and b"the server is shutting down" in content.split(b"\n\n")[-2]
            else:
                assert sent[0]["status"] == 503, content
                assert json.loads(content)["error"]["message"] == "the server is shutting down; retry the request"
                assert 1000 <= int(dict(sent[0]["headers"])[b"retry-after-ms"]) < 2000
        assert state.engine.pending == 0
    finally:
        state.close()


def test_lines_routed_to_uvicorn_s_handlers_are_not_logged_again_by_a_root_handler_added_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``log_where_uvicorn_logs`` hands the example's lines to uvicorn's handlers; a root handler
    a program adds after that (``logging.basicConfig`` at its first warning, say) would log each
    line a second time unless they stop there."""
    import logging

    from examples.server import app as app_module

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    uvicorn_s, root_s = Kept(), Kept()
    root, ours = logging.getLogger(), app_module.logger
    monkeypatch.setattr(root, "handlers", [])  # pytest's own capture: "the program configured logging"
    monkeypatch.setattr(logging.getLogger("uvicorn"), "handlers", [uvicorn_s])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    level = ours.level
    try:
        app_module.log_where_uvicorn_logs()
        root.handlers.append(root_s)
        ours.warning("a line")
    finally:
        ours.setLevel(level)  # setLevel, not an attribute put back: it clears the loggers' cached levels
    assert uvicorn_s.lines == ["a line"] and root_s.lines == []
