"""Subprocess entry point for tests/test_exactness.py's restart test: a fresh interpreter.

Protocol::

    python tests/_restart_child.py SPEC.json

``SPEC.json`` holds ``{"path", "block_size", "new_tokens", "session_prefix", "conversations":
{arch: [token ids]}}``. The child reopens the store at ``path``, rebuilds each architecture's
tiny model with ``conftest.make_model(arch)`` (same seed, so the same weights), opens each
conversation, greedily generates through the restored cache and without a cache, commits, closes
the store, and prints one line ``RESULT <json>`` with, per architecture: restored_tokens,
restored_from, the two outputs, the cache length after generate and the commit's return value.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from conftest import make_model  # noqa: E402
from tierkv import TieredStore  # noqa: E402


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    results: dict[str, dict[str, object]] = {}
    with TieredStore(spec["path"], device="cpu", block_size=spec["block_size"],
                     device_budget="1GiB", host_budget="1GiB") as store:
        for arch, ids_list in spec["conversations"].items():
            model = make_model(arch)
            ids = torch.tensor([ids_list], dtype=torch.long)
            cache = store.open(model, ids, session=spec["session_prefix"] + arch)
            restored_tokens, restored_from = cache.restored_tokens, dict(cache.restored_from)
            out = model.generate(ids, past_key_values=cache, max_new_tokens=spec["new_tokens"], do_sample=False)
            plain = model.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False)
            seq_length = cache.get_seq_length()
            committed = cache.commit(out)
            results[arch] = {
                "restored_tokens": restored_tokens,
                "restored_from": restored_from,
                "tierkv": out[0].tolist(),
                "plain": plain[0].tolist(),
                "seq_length": seq_length,
                "committed": committed,
            }
        stats = store.stats()
    print("RESULT " + json.dumps({"results": results, "hits": stats["hits"], "corrupt": stats["corrupt"]}))


if __name__ == "__main__":
    main(sys.argv[1])
