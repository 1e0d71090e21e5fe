"""Quantities given by users: byte counts (``2GiB``, ``"512MiB"``, ``1.5e9``) and whole numbers.

``parse_bytes(value, name)`` reads a byte count; ``whole_number(value, name)`` an int argument
(numpy's integers too, never a bool); ``seconds_or_none(value, name)`` a timeout; ``absolute_path(path)``
a directory path as the kernel resolves it; ``shell_path(path)`` a path as a command in a message
spells it. KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000, ``B`` or no unit
means bytes. Fractions of KB and larger units are allowed and rounded down to whole bytes
(``"0.1GiB"`` is 107374182.4 bytes); a fraction of a byte is refused: a float such as ``1.5``,
``"1.5B"`` or ``"1.5"`` (a unit left off, or a computed budget not made whole). Anything else
raises with the accepted forms in the message.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import shlex
from decimal import Decimal

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_MAX_BYTES = 2**63 - 1
_FORMS = 'an int of bytes, or a string like "512MiB", "1.5GB", "2GiB" (units B, KB/MB/GB/TB, KiB/MiB/GiB/TiB)'


def parse_bytes(value: object, name: str = "budget") -> int:
    """Return ``value`` as a whole number of bytes, or raise ``ValueError``/``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {_FORMS}; got the bool {value!r}")
    # numbers.Integral/Real: numpy's scalars too (a budget computed with numpy is an np.int64).
    if isinstance(value, numbers.Integral):
        number: float | Decimal = int(value)
    elif isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number of bytes; got {value!r}. Use {_FORMS}.")
        # A negative one is told below to give 0, not to write "-0.5GiB".
        if not number.is_integer() and number > 0:
            # 1.5 meant as 1.5GiB was one byte: every block evicted, a reopened store's included.
            # Refused at any size, as "1288490188.8B" is: a float is a count of bytes.
            instead = (f"a string with a unit, like \"{number:g}GiB\", or a whole number of bytes" if number < 1024
                       else f"a whole number of bytes, like int({value!r}) for a computed budget")
            raise ValueError(f"{name}={value!r} is not a whole number of bytes; give {instead}")
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            if value.strip().startswith("-"):
                raise ValueError(f"{name} must not be negative; got {value!r}. Use 0 to keep nothing at rest in this tier.")
            raise ValueError(f"cannot read {name}={value!r} as a byte count; use {_FORMS}")
        unit = match.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown byte unit {match.group(2)!r} in {name}={value!r}; use {_FORMS}")
        # Decimal, not float: "2.01KB" is 2010 bytes, not 2009.
        try:
            number = Decimal(match.group(1)) * _UNITS[unit]
        except ArithmeticError:  # decimal.Overflow: an exponent past Decimal's range ("1e9999999999")
            raise ValueError(f"{name}={value!r} is larger than any machine's storage ({_MAX_BYTES} bytes); "
                             f"use {_FORMS}") from None
        if unit in ("", "b") and number != number.to_integral_value():
            # "1.5": a unit left off; "1.5B": "1.5GB" with its G left off (a byte and a half
            # would evict nearly everything). Rounding down told neither.
            raise ValueError(f"{name}={value!r} is a fraction of a byte; give a {'larger ' if unit else ''}unit, "
                             f"like \"{match.group(1)}GiB\", or a whole number of bytes")
    else:
        raise TypeError(f"{name} must be {_FORMS}; got {type(value).__name__}")
    if number < 0:
        raise ValueError(f"{name} must not be negative; got {value!r}. Use 0 to keep nothing at rest in this tier.")
    if number > _MAX_BYTES:
        raise ValueError(f"{name}={value!r} is larger than any machine's storage ({_MAX_BYTES} bytes); "
                         f"use {_FORMS}")
    return int(number)


def whole_number(value: object, name: str, minimum: int, advice: str = "", maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``, or ``TypeError``/``ValueError`` naming ``name``.
    numpy's integers are taken; a bool, a float or a string is not (``1.0`` tokens is a mistake
    somewhere upstream, not a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}{advice}")
    number = int(value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}{advice}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}{advice}")
    return number


def seconds_or_none(value: object, name: str) -> float | None:
    """A timeout: None (wait as long as it takes; ``inf`` too) or seconds >= 0. A negative one is
    refused rather than read as "no timeout", as -1 often means elsewhere: here it would drop
    every queued write at once."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be None or a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be None (drain every queued write) or seconds >= 0, got {value!r}")
    return None if math.isinf(seconds) else seconds


def format_bytes(n: int) -> str:
    """Human-readable form for logs and tables (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def shell_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a shell command given in a message must spell it to be run as printed: quoted
    where it holds spaces or other characters the shell reads (``my store``: ``tierkv check my
    store --repair`` named two arguments), and a relative one starting with ``-`` led by ``./``,
    or the command reads it as an option."""
    text = os.fspath(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


def absolute_path(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute as the kernel resolves it: joined to the working directory, its
    ``..`` left for the kernel. ``os.path.abspath`` drops a ``..`` with the name before it, and
    where that name is a symbolic link to a directory (``current/../kvstore``) the kernel goes
    to the parent of the link's target: the store opened, created or deleted was another
    directory than the one the user named (and than ``os.path.exists`` checked)."""
    path = os.fspath(path)
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
