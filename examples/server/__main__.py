"""Run the chat server: ``python -m examples.server [--port 8000] [--store DIR] ...`` (``--help`` lists all).

Every flag falls back to a ``TIERKV_*`` environment variable, then to its default; the default
model is a tiny random Llama with a byte-level tokenizer, built locally (nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Sequence

from .settings import parse_args


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_args(argv, description=__doc__, listen=True)  # a host or port it cannot use: before the model loads
    import uvicorn  # after parsing: --help and flag errors answer without loading torch

    from .app import create_app

    # Without a timeout, SIGTERM waits for every queued turn; past it, uvicorn cancels the requests still
    # in flight, which the app answers 503 while the running turn stops at its next token and commits.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=settings.timeout_graceful_shutdown)


if __name__ == "__main__":
    main()
