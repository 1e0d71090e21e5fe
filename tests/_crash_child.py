"""Subprocess for tests/test_crash.py: commits conversations forever, flushing now and then.

    python tests/_crash_child.py PATH SEED

After every third conversation it calls ``store.flush()`` and prints ``FLUSHED <i>``: every
conversation up to ``i`` is then durable. Between flushes, commits keep spilling through the
background writer, so a SIGKILL lands at a random point of the write path. Not collected by pytest.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_model, random_ids  # noqa: E402
from tierkv import TieredStore  # noqa: E402


def conversation(seed: int, i: int):
    return random_ids(20 + i % 7, seed * 1000 + i)


def main(path: str, seed: int) -> None:
    model = make_model("llama")
    store = TieredStore(path, device="cpu", block_size=4, device_budget=0, host_budget=0)
    print("READY", flush=True)
    for i in range(10_000):
        ids = conversation(seed, i)
        cache = store.open(model, ids, session=f"s{i}")
        cache.commit(model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False))
        if i % 3 == 2:
            store.flush()
            print(f"FLUSHED {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
