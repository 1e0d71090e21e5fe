"""Settings of the chat server: defaults, overridden by ``TIERKV_*`` environment variables, then by flags.

Every setting has one row in ``_FIELDS``: its flag, its environment variable and its parser, so the
three sources cannot drift apart. ``Settings.from_env()`` is what ``uvicorn examples.server.app:app``
uses; ``parse_args()`` is what ``python -m examples.server`` uses (flags default to the environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The tiny model's context. Fixed, not derived from the request limits: the config is part of the
# model's fingerprint, so a change of limits must not orphan every block in the store.
MAX_POSITIONS = 8192
# The seeds torch.manual_seed takes (a negative one is read modulo 2**64); it overflows beyond.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The longest model id a request may name (``schemas``): the served one must fit, or clients that send
# back what /v1/models lists are refused.
MAX_MODEL_CHARS = 256


@dataclass(frozen=True, slots=True)
class Settings:
    """What the server runs: the model, the store and its budgets, request limits, where it listens."""

    model: str = "tiny"                 # "tiny": the built-in random byte-level model (no download)
    model_name: str = "tierkv-tiny"     # the id /v1/models lists; requests' "model" is echoed as sent
    seed: int = 0                       # weights of the tiny model: same seed, same weights, same cache keys
    tiny_layers: int = 4
    tiny_hidden: int = 256
    store: str | None = "kvstore-server"  # disk tier directory; None (flag/env "none" or "") = no disk tier
    device: str | None = None           # hot tier and model device; None = cuda when available, else cpu
    device_budget: str = "256MiB"
    host_budget: str = "1GiB"
    disk_budget: str = "8GiB"
    block_size: int = 64
    max_input_tokens: int = 4096        # prompt tokens (the whole templated conversation) per request
    max_output_tokens: int = 512        # the largest max_tokens a request may ask for
    default_max_tokens: int = 128       # when a request gives none
    max_body_bytes: int = 4 * 2**20     # request bodies beyond this are refused with 413 before parsing
    max_pending_turns: int = 64         # turns (and session deletes) queued or running; past it: 429
    sse_keep_alive: float = 15.0        # seconds without a chunk before a stream sends a ": keep-alive" comment
    timeout_graceful_shutdown: float | None = None  # seconds uvicorn waits for requests on SIGTERM; None: all
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        """Everything the server would otherwise find wrong at startup, after loading torch and the
        model, with a traceback."""
        for name in ("tiny_layers", "tiny_hidden", "block_size", "max_input_tokens", "max_output_tokens",
                     "default_max_tokens", "max_body_bytes", "max_pending_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must not exceed max_output_tokens "
                             f"({self.max_output_tokens})")
        if not 0 < len(self.model_name) <= MAX_MODEL_CHARS or self.model_name != self.model_name.strip():
            raise ValueError(f"model_name must be 1 to {MAX_MODEL_CHARS} characters without spaces at either end (the "
                             f"id /v1/models lists, which requests name), got {self.model_name!r}")
        if self.model != "tiny":
            raise ValueError(f"model {self.model!r} is not available: this example serves the built-in random "
                             "model only (--model tiny), since nothing can be downloaded")
        heads = self.tiny_hidden // 64
        if self.tiny_hidden % 64 or heads % max(1, heads // 2):
            raise ValueError(f"tiny_hidden must be 64, 128, 192 or a multiple of 128 (heads of 64 sharing KV heads "
                             f"in pairs), got {self.tiny_hidden}")
        if self.max_input_tokens + self.max_output_tokens > MAX_POSITIONS:
            raise ValueError(f"max_input_tokens + max_output_tokens must be <= {MAX_POSITIONS}, the model's context; "
                             f"got {self.max_input_tokens} + {self.max_output_tokens}")
        # A proxy's idle timeout (nginx's 60 s) cuts a stream that sends nothing for longer than this.
        if not (math.isfinite(self.sse_keep_alive) and 0 < self.sse_keep_alive <= 3600):
            raise ValueError(f"sse_keep_alive must be more than 0 and at most 3600 seconds (below the idle timeout "
                             f"of the proxies in front), got {self.sse_keep_alive}")
        if self.timeout_graceful_shutdown is not None and not (
                math.isfinite(self.timeout_graceful_shutdown) and self.timeout_graceful_shutdown >= 0):
            raise ValueError(f"timeout_graceful_shutdown must be 0 or more seconds, or none to wait for every "
                             f"request, got {self.timeout_graceful_shutdown}")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in {SEED_MIN}..{SEED_MAX} (what torch.manual_seed takes), got {self.seed}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.host.strip():
            # uvicorn (like socket.bind) reads "" as every interface, and this server checks no keys: a
            # TIERKV_HOST= left empty must not expose it. Refused, not read as the default, since to the
            # socket API "" means everywhere: whoever wrote it may have meant either.
            raise ValueError("host is empty, which would listen on every interface; pass --host 0.0.0.0 (or ::) "
                             "to listen everywhere (put an authenticating proxy in front), or leave it unset for "
                             "127.0.0.1")
        if self.store is not None and os.path.exists(self.store) and not os.path.isdir(self.store):
            raise ValueError(f"store {self.store!r} is a file; give a directory (made if missing), or 'none'")
        from tierkv.store import MAX_BLOCK_SIZE  # loads torch: only once the cheap checks passed
        from tierkv.transfer import resolve_device
        from tierkv.units import parse_bytes

        if self.block_size > MAX_BLOCK_SIZE:  # else the store refuses it at startup, after the model loaded
            raise ValueError(f"block_size must be <= {MAX_BLOCK_SIZE} tokens, got {self.block_size}; the default, "
                             "64, suits this model")

        for name in ("device_budget", "host_budget", "disk_budget"):
            parse_bytes(getattr(self, name), name)
        if self.device is not None:  # None (auto) always resolves
            try:
                resolve_device(self.device)
            except ValueError as exc:
                # The library's advice names its arguments (device=None); here the setting is a flag.
                reason = str(exc).split("; ")[0]
                raise ValueError(f"{reason}; pass --device cpu, cuda or cuda:N, or leave --device (TIERKV_DEVICE) "
                                 "unset for CUDA where it is available, else the CPU") from None
        self._check_stored_block_size()

    def _check_stored_block_size(self) -> None:
        """The store must open, as far as its directory tells, and an existing store's block size must be this
        one: else the store refuses to open at startup, after the model loaded. Reads the store's meta record
        without its lock, so it must run before this process opens the store."""
        from tierkv.tiers.disk import DiskTier

        if self.store is None:
            return
        # A new directory too: a linked lock.mdb or tierkv.lock, or a data.mdb linked to a missing target
        # (no data.mdb to read a block size from), were refused only at startup.
        path = DiskTier.check_openable(self.store)  # as the store resolves it
        data = os.path.join(path, "data.mdb")
        if not (os.path.isfile(data) and os.path.getsize(data) > 0):
            return  # a new store, made at startup with this block size
        stored = DiskTier.stored_meta(path)["block_size"]  # raises ValueError for a directory that holds no store
        if stored != self.block_size:
            raise ValueError(f"store {self.store!r} was created with block_size={stored}; pass --block-size {stored} "
                             f"(TIERKV_BLOCK_SIZE={stored}), or another store directory")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then ``TIERKV_*`` variables of ``environ`` (default ``os.environ``), then ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (_, env, parse, _) in _FIELDS.items():
            if env in environ:
                try:
                    values[name] = parse(environ[env])
                except ValueError as exc:
                    raise ValueError(f"{env}={environ[env]!r}: {exc}") from None
        return cls(**{**values, **overrides})


def _optional_path(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none") else text


def _optional_str(text: str) -> str | None:
    return text or None


def _optional_seconds(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none") else float(text)


# field -> (flag, environment variable, parser, help)
_FIELDS: dict[str, tuple[str, str, Callable[[str], Any], str]] = {
    "model": ("--model", "TIERKV_MODEL", str, "the model: tiny, the built-in random model with a byte-level tokenizer"),
    "model_name": ("--model-name", "TIERKV_MODEL_NAME", str, "model id listed by /v1/models"),
    "seed": ("--seed", "TIERKV_SEED", int, "seed of the tiny model's weights"),
    "tiny_layers": ("--tiny-layers", "TIERKV_TINY_LAYERS", int, "layers of the tiny model"),
    "tiny_hidden": ("--tiny-hidden", "TIERKV_TINY_HIDDEN", int, "hidden size of the tiny model: 64, 128, 192 or a multiple of 128"),
    "store": ("--store", "TIERKV_STORE", _optional_path, "disk tier directory, or 'none' for no disk tier"),
    "device": ("--device", "TIERKV_DEVICE", _optional_str, "device of the model and hot tier; auto: cuda when available, else cpu"),
    "device_budget": ("--device-budget", "TIERKV_DEVICE_BUDGET", str, "bytes at rest on the device: an int, or 512MiB, 1.5GB"),
    "host_budget": ("--host-budget", "TIERKV_HOST_BUDGET", str, "bytes at rest in host memory"),
    "disk_budget": ("--disk-budget", "TIERKV_DISK_BUDGET", str, "bytes at rest on disk"),
    "block_size": ("--block-size", "TIERKV_BLOCK_SIZE", int, "tokens per block"),
    "max_input_tokens": ("--max-input-tokens", "TIERKV_MAX_INPUT_TOKENS", int, "largest prompt, in tokens"),
    "max_output_tokens": ("--max-output-tokens", "TIERKV_MAX_OUTPUT_TOKENS", int, "largest max_tokens accepted"),
    "default_max_tokens": ("--default-max-tokens", "TIERKV_DEFAULT_MAX_TOKENS", int, "max_tokens when not given"),
    "max_body_bytes": ("--max-body-bytes", "TIERKV_MAX_BODY_BYTES", int, "largest request body, in bytes"),
    "max_pending_turns": ("--max-pending-turns", "TIERKV_MAX_PENDING_TURNS", int,
                          "turns (and session deletes) queued or running at once; a request past it gets a 429 to retry"),
    "sse_keep_alive": ("--sse-keep-alive", "TIERKV_SSE_KEEP_ALIVE", float,
                       "seconds a stream may send nothing (queued, or generating) before it sends a keep-alive comment"),
    "timeout_graceful_shutdown": ("--timeout-graceful-shutdown", "TIERKV_TIMEOUT_GRACEFUL_SHUTDOWN", _optional_seconds,
                                  "seconds a shutdown (SIGTERM) waits for requests in flight, then answers them 503; "
                                  "none: waits for every queued turn"),
    "host": ("--host", "TIERKV_HOST", str, "address to listen on"),
    "port": ("--port", "TIERKV_PORT", int, "port to listen on"),
}
assert set(_FIELDS) == {f.name for f in dataclasses.fields(Settings)}


def check_listen(host: str, port: int) -> None:
    """The ``ValueError`` that says why this process cannot listen on ``host``:``port`` (a name that
    does not resolve, an address not of this machine, a port in use or reserved), found before the
    model loads: uvicorn binds only after its startup, and then logs the bare reason. Each address
    the host resolves to is bound as asyncio's server binds it (``SO_REUSEADDR``, v6 only for IPv6),
    then released for uvicorn (a port taken in between is still reported by uvicorn)."""
    import socket

    where = f"--host {host!r} --port {port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        hint = "; give the port with --port, not in --host" if host.rpartition(":")[2].isdigit() else ""
        raise ValueError(f"cannot listen on {where}: the host does not resolve ({exc}){hint}") from None
    for family, kind, proto, _, address in dict.fromkeys(addresses):  # getaddrinfo may repeat one
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ValueError(f"cannot listen on {where} (address {address[0]}): {exc.strerror or exc}") from None


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
               description: str | None = None, listen: bool = False) -> Settings:
    """Settings from flags; a flag not given falls back to its environment variable, then the default.
    ``listen``: also check that the host and port can be listened on (``check_listen``)."""
    parser = argparse.ArgumentParser(prog="python -m examples.server", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    for name, (flag, env, parse, text) in _FIELDS.items():
        # The defaults are Settings' own, shown here so that --help alone tells what a flag left out gives.
        shown = ("auto" if name == "device" else "none") if defaults[name] is None else defaults[name]
        parser.add_argument(flag, dest=name, type=parse, default=argparse.SUPPRESS,
                            help=f"{text} (default: {shown}) [${env}]")
    args = vars(parser.parse_args(argv))
    try:
        settings = Settings.from_env(environ, **args)
        if listen:
            check_listen(settings.host, settings.port)
        return settings
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this line is for type checkers
