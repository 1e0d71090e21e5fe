"""Generation for the server: one model, one worker thread, and a tierkv turn per request.

Protocol::

    engine = Engine(model, tokenizer, store, max_pending=64)
    result = await engine.complete(turn, until)   # -> TurnResult; TurnCancelled once until() returns first
    async for item in engine.stream(turn, keep_alive=15.0): ...  # text deltas (str), then the TurnResult;
                                                  # None after each 15 s with nothing to send (queued, or quiet)
    admission = engine.admit()                    # counted in pending now; QueueFull at max_pending
    engine.stream(turn, admission=admission)      # ... which the stream gives back when it ends
    n = await engine.call(store.forget, ...)      # anything that must come after the turns queued before it
                                                  # (counted in pending, QueueFull and ServerClosing as a turn)
    engine.close()                                # finish the running turn, drop the queued ones

Every turn runs, on the engine's one worker thread::

    cache = store.open(model, ids, session=..., tenant=...)    # restore the longest stored prefix
    out = model.generate(ids, cache=cache, ...)                # compute only the rest
    cache.commit(out)                                          # store the new blocks for the next turn

Why one worker thread rather than a lock around ``generate``: the model is one shared, compute-bound
object, so concurrent ``generate`` calls would only contend; a single worker serialises turns in
arrival order, keeps the event loop free (``/healthz`` answers while a turn runs), and lets a turn
whose client left before it started be dropped from the queue. The commit runs on the worker right
after ``generate``, before anything is handed back, so streamed turns commit too. A turn whose client
disconnects (a stream closed, or ``complete``'s ``until`` returned) is dropped if it has not started,
and otherwise stops at the next token and commits what it generated.

``pending`` (turns and calls queued or running) is bounded by ``max_pending``: a turn past it is refused with
``QueueFull`` before anything is queued. A streamed turn gives its place back as it leaves the worker, whether
or not its client has read it yet (the worker never waits for a client: deltas queue without bound, at most
``max_tokens`` of them). ``complete`` counts its turn as it is called; a stream's
generator runs only once its response has started, so whoever must refuse it before that (with a
status, not an error event) counts it with ``admit`` first, and gives the count back with
``Admission.release`` if the stream never ran (releasing twice is a no-op).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)
from transformers.generation.streamers import BaseStreamer

from tierkv import TieredStore

from .settings import MAX_POSITIONS, Settings
from .tokenizer import BOS, END, VOCAB_SIZE, ByteChatTokenizer

T = TypeVar("T")


def build_model(settings: Settings) -> tuple[torch.nn.Module, ByteChatTokenizer]:
    """The model and tokenizer ``settings.model`` names (only "tiny" here), in eval mode, on the CPU."""
    heads = settings.tiny_hidden // 64  # Settings checked the model's shape and limits
    config = AutoConfig.for_model("llama", vocab_size=VOCAB_SIZE, hidden_size=settings.tiny_hidden,
                                  intermediate_size=2 * settings.tiny_hidden, num_hidden_layers=settings.tiny_layers,
                                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                  max_position_embeddings=MAX_POSITIONS, bos_token_id=BOS, eos_token_id=END,
                                  pad_token_id=END)
    # Same seed, same weights, same fingerprint: a restarted server finds its sessions on disk.
    # fork_rng: building the model must not reseed the process's RNG that sampling uses.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    return model, ByteChatTokenizer()


@dataclass(frozen=True, slots=True)
class Turn:
    """One request, validated: the templated conversation and how to continue it."""

    ids: list[int]
    session: str | None
    tenant: str | None
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0: greedy
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What one turn generated, and what tierkv restored for it."""

    text: str
    finish_reason: str  # "stop" (end of turn or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)


class TurnCancelled(Exception):
    """The client left before its turn finished (``complete``), or before it started (the worker)."""


class ServerClosing(TurnCancelled):
    """``Engine.close`` dropped the turn from the queue before it ran, or it came after (the server shuts down)."""


class QueueFull(Exception):
    """``max_pending`` turns or calls are queued or running already: this one is refused, nothing was queued."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} turns (or session deletes) are queued or running already, this server's limit")
        self.limit = limit


class Admission:
    """One turn counted in ``Engine.pending``; ``release`` gives the count back, once."""

    def __init__(self, engine: "Engine") -> None:
        self._engine: Engine | None = engine
        engine.pending += 1

    def release(self) -> None:
        if self._engine is not None:
            self._engine.pending -= 1
            self._engine = None


class _Streamer(BaseStreamer):
    """Hands each new token to ``on_tokens``; ``generate`` puts the prompt first, which is skipped."""

    def __init__(self, on_tokens: Callable[[list[int]], None]) -> None:
        self._on_tokens = on_tokens
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._on_tokens(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class _StopStrings(StoppingCriteria):
    """Stops once the reply's text contains one of ``stops``."""

    def __init__(self, tokenizer: ByteChatTokenizer, prompt_len: int, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._prompt_len = prompt_len
        self._stops = stops
        # Checked after every token, so a stop string first appears near the end: only a tail is
        # decoded, not the whole reply each step.
        self._window = max(map(len, stops)) + 4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
        start = max(self._prompt_len, input_ids.shape[1] - self._window)
        tail = self._tokenizer.decode(input_ids[0, start:].tolist())
        hit = any(s in tail for s in self._stops)
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool,  # type: ignore[return-value]
                          device=input_ids.device)


def _final_chars(text: str, stops: tuple[str, ...], hold: int) -> int:
    """How many leading characters of ``text``, a reply so far, the finished reply keeps whatever
    tokens follow: none from the earliest stop string on (the reply is cut there), and not the last
    ``hold`` (the longest stop's length - 1), which may begin a stop string the next tokens complete.

    The token completing a stop string reaches the streamer before generation stops, so the cut must
    be found in ``text`` itself, not only held back from. No stop string can begin before
    ``len(text) - hold`` without lying in ``text`` whole, so what this allows is never cut later. The
    generated bytes are ASCII (see ``tokenizer``), so a longer reply never re-decodes this prefix.
    """
    return min([len(text) - hold, *(i for i in (text.find(s) for s in stops) if i >= 0)])


class _Penalties(LogitsProcessor):
    """OpenAI's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias``, as OpenAI defines them::

        logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty + logit_bias[j]

    ``count[j]``: how often token j was generated so far in this reply (the prompt does not count).
    Applied to the raw logits, before temperature and top_p (``generate`` puts the processors it is
    given before its own sampling ones).
    """

    def __init__(self, prompt_len: int, frequency: float, presence: float, bias: tuple[tuple[int, float], ...]) -> None:
        self._prompt_len = prompt_len
        self._frequency = frequency
        self._presence = presence
        self._bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        generated = input_ids[:, self._prompt_len:]
        if generated.shape[1] and (self._frequency or self._presence):
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            scores -= counts * self._frequency + (counts > 0).to(scores.dtype) * self._presence
        for token, bias in self._bias:
            scores[:, token] += bias
        return scores  # type: ignore[return-value]


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self._event.is_set(), dtype=torch.bool,  # type: ignore[return-value]
                          device=input_ids.device)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    # Turns run one at a time, so seeding the process RNG for one turn cannot disturb another;
    # fork_rng restores it afterwards, so unseeded requests do not inherit a request's seed.
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class Engine:
    """Runs turns one at a time on a worker thread; see the module docstring for the protocol."""

    def __init__(self, model: torch.nn.Module, tokenizer: ByteChatTokenizer, store: TieredStore,
                 max_pending: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.pending = 0  # turns and calls queued or running; touched on the event loop only
        self.max_pending = max_pending  # None: unbounded
        # A moving average of the turns' wall time (None before the first): about when a full
        # queue frees its next place, for the 429's Retry-After (``retry_after``).
        self.turn_seconds: float | None = None
        self._closing = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-generate")
        self._suppress = list(tokenizer.suppress_ids)

    def admit(self) -> Admission:
        """Count one more turn in ``pending``, or raise ``QueueFull`` (nothing counted) at ``max_pending``.
        Checked and counted without an await between, so concurrent requests cannot both take the last place."""
        if self.max_pending is not None and self.pending >= self.max_pending:
            raise QueueFull(self.max_pending)
        return Admission(self)

    def retry_after(self) -> float:
        """Seconds a client refused with ``QueueFull`` should wait at least: about one turn, the time
        until the running one ends and frees a place; 1 before any turn ran, never less (a retry at
        once would find the same queue), 60 at most. The 429 spreads the burst it refuses from there
        (``errors.RetryAfter``)."""
        return min(60.0, max(1.0, self.turn_seconds or 1.0))

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the worker thread after every turn submitted before it; ``ServerClosing`` once
        ``close`` was called (the executor's own refusal, a ``RuntimeError``, would be a 500)."""
        if self._closing:
            raise ServerClosing()
        try:
            return self._executor.submit(fn, *args, **kwargs)
        except RuntimeError:
            if self._closing:  # close() ran between the check and the submit
                raise ServerClosing() from None
            raise

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn``'s result, from the worker thread; ``ServerClosing`` where ``close`` dropped it unrun.
        It holds a place in ``pending`` as a turn does (``QueueFull`` past ``max_pending``): a flood of
        session deletes would otherwise queue without bound, ahead of the turns that come after."""
        admission = self.admit()
        try:
            submitted = self.submit(fn, *args, **kwargs)
            return await self._outcome(asyncio.wrap_future(submitted), submitted)
        finally:
            admission.release()

    async def complete(self, turn: Turn, until: Callable[[], Awaitable[object]] | None = None) -> TurnResult:
        """The turn's result; ``until()`` (say, the client's disconnect) returning first cancels the turn
        (dropped if still queued, else stopped at its next token) and raises ``TurnCancelled``."""
        cancel = threading.Event()
        admission = self.admit()
        watcher: asyncio.Future[object] | None = None
        try:
            submitted = self.submit(self._run, turn, None, cancel)
            future = asyncio.wrap_future(submitted)
            try:
                if until is not None:
                    watcher = asyncio.ensure_future(until())
                    await asyncio.wait((future, watcher), return_when=asyncio.FIRST_COMPLETED)
                    if not future.done():
                        raise TurnCancelled()
                return await self._outcome(future, submitted)
            finally:
                cancel.set()  # no-op after the turn finished; else the worker stops at its next token
                if not future.done():
                    future.cancel()  # a queued turn is dropped; a running one's outcome is not wanted
        finally:
            admission.release()
            if watcher is not None:
                watcher.cancel()
                # Retrieved, so that a watcher that failed (rather than returned) logs no "never retrieved".
                watcher.add_done_callback(lambda w: w.cancelled() or w.exception())

    async def stream(self, turn: Turn, keep_alive: float | None = None,
                     admission: Admission | None = None) -> AsyncIterator[str | TurnResult | None]:
        """Text deltas as tokens arrive, then the ``TurnResult``; the deltas join to its text. With
        ``keep_alive``, also ``None`` each time that many seconds passed with nothing to send (queued,
        or a turn gone quiet), for the caller to keep its connection alive with. ``admission``: the
        turn's count in ``pending``, taken by ``admit`` (else the stream takes it as it starts)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: list[int] | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def release_soon(admission: Admission) -> None:
            with contextlib.suppress(RuntimeError):  # pending is the event loop's to touch
                loop.call_soon_threadsafe(admission.release)

        hold = max(map(len, turn.stop), default=1) - 1
        ids: list[int] = []
        sent = 0
        future: asyncio.Future[TurnResult] | None = None
        admission = self.admit() if admission is None else admission
        try:  # from the count on: whatever raises (submit, once closed), the count is given back
            submitted = self.submit(self._run, turn, emit, cancel)
            # The end of the deltas, after the job's last emit; also for a turn close() drops unrun
            # (a job's own `finally` never ran then, and the consumer below waited forever).
            submitted.add_done_callback(lambda _: emit(None))
            # The place is the queue's: given back as the job leaves the worker, not once the client
            # read every delta. A client that keeps its connection and reads nothing stops this
            # generator at its next yield (the server's send waits for the socket), and held the
            # place for good, its turn long committed: enough of them and every request got a 429.
            submitted.add_done_callback(lambda _: release_soon(admission))
            future = asyncio.wrap_future(submitted)
            while True:
                try:
                    # Cancelling a Queue.get loses no item: put_nowait stores it before waking the getter.
                    tokens = await asyncio.wait_for(queue.get(), keep_alive)
                except TimeoutError:
                    yield None
                    continue
                if tokens is None:
                    break
                ids.extend(tokens)
                text = self.tokenizer.decode(ids)
                ready = _final_chars(text, turn.stop, hold)
                if ready > sent:
                    yield text[sent:ready]
                    sent = ready
            result = await self._outcome(future, submitted)
            if len(result.text) > sent:
                yield result.text[sent:]
            yield result
        finally:
            admission.release()
            cancel.set()  # no-op after the turn finished; else the worker stops at its next token
            if future is not None and not future.done():
                future.cancel()  # a queued turn is dropped; a running one's outcome is not wanted

    def close(self) -> None:
        """Let the running turn finish (and commit), drop the queued ones (their callers get
        ``ServerClosing``), stop the worker."""
        self._closing = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _outcome(self, future: asyncio.Future[T], submitted: concurrent.futures.Future[T]) -> T:
        """The turn's result; ``ServerClosing`` where ``close`` dropped it, rather than the bare
        ``CancelledError`` of its cancelled future."""
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Not when this task itself is being cancelled (the caller's timeout, the server's).
            if self._closing and submitted.cancelled() and not (task is not None and task.cancelling()):
                raise ServerClosing() from None
            raise

    def _run(self, turn: Turn, on_tokens: Callable[[list[int] | None], None] | None,
             cancel: threading.Event | None) -> TurnResult:
        if cancel is not None and cancel.is_set():
            raise TurnCancelled()
        started = time.monotonic()
        ids = torch.tensor([turn.ids], dtype=torch.long, device=self.store.device)
        cache = self.store.open(self.model, ids, session=turn.session, tenant=turn.tenant)
        criteria = StoppingCriteriaList()
        if turn.stop:
            criteria.append(_StopStrings(self.tokenizer, ids.shape[1], turn.stop))
        if cancel is not None:
            criteria.append(_Cancelled(cancel))
        sampling: dict[str, Any] = dict(do_sample=False)
        processors = LogitsProcessorList()
        if turn.frequency_penalty or turn.presence_penalty or turn.logit_bias:
            processors.append(_Penalties(ids.shape[1], turn.frequency_penalty, turn.presence_penalty, turn.logit_bias))
        # Below this, dividing logits by the temperature overflows float32: such a turn is greedy. So is
        # top_p 0 (OpenAI's range includes it), which keeps only the most likely token; transformers'
        # top_p would keep it too, but draw from the RNG for it.
        if turn.temperature >= 1e-5 and turn.top_p > 0:
            # top_k=0: OpenAI's API has no top-k, and transformers would otherwise apply its default of 50.
            # generate applies the processors it is given (the penalties) before its temperature and top_p.
            sampling = dict(do_sample=True, temperature=turn.temperature, top_p=turn.top_p, top_k=0)
        with _seeded(turn.seed, ids.device):
            out = self.model.generate(ids, cache=cache, max_new_tokens=turn.max_tokens,
                                      suppress_tokens=self._suppress, eos_token_id=END, pad_token_id=END,
                                      stopping_criteria=criteria, logits_processor=processors,
                                      streamer=_Streamer(on_tokens) if on_tokens is not None else None,
                                      **sampling)
        cache.commit(out)
        took = time.monotonic() - started
        self.turn_seconds = took if self.turn_seconds is None else 0.8 * self.turn_seconds + 0.2 * took
        generated = out[0, ids.shape[1]:].tolist()
        ended = bool(generated) and generated[-1] == END
        text = self.tokenizer.decode(generated)
        cuts = [i for i in (text.find(s) for s in turn.stop) if i >= 0]
        if cuts:
            text = text[:min(cuts)]  # OpenAI's stop: the reply ends before the stop string
        return TurnResult(text=text, finish_reason="stop" if ended or cuts else "length",
                          prompt_tokens=len(turn.ids), completion_tokens=len(generated),
                          cached_tokens=cache.restored_tokens, cached_by_tier=dict(cache.restored_from))
