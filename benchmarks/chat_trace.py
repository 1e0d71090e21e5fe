"""The multi-session chat trace from a checkout: ``python -m benchmarks.chat_trace [--quick ...]``.

The benchmark lives in ``tierkv.bench`` so that an installed package runs it too, as ``tierkv bench``;
here its reports default to ``benchmarks/out/chat_trace`` (ignored by git), beside the other benchmarks'.
"""

from __future__ import annotations

from tierkv import bench


def main(argv: list[str] | None = None) -> dict:
    return bench.main(argv, default_out="benchmarks/out/chat_trace")


if __name__ == "__main__":
    main()
