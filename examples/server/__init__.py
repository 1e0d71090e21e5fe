"""A multi-session chat server in front of tierkv: OpenAI's chat-completions API over HTTP.

    python -m examples.server --store kvstore-server/      # or: uvicorn examples.server.app:app

``app`` (routes, identity, lifespan), ``engine`` (the tierkv turn on one worker thread),
``tokenizer`` (the byte-level chat template), ``schemas`` (the wire format), ``errors`` (OpenAI
error bodies), ``settings`` (flags and ``TIERKV_*`` variables). Kept free of imports here, so
that ``python -m examples.server --help`` answers without loading torch.
"""
