"""tierkv.units.parse_bytes: every accepted form gives the exact byte count; every bad form raises
the right exception type with a message that names the accepted forms. whole_number: ints and
numpy's integers, nothing else."""

from __future__ import annotations

import math
import re
import shlex
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tierkv.units import format_bytes, parse_bytes, seconds_or_none, shell_path, whole_number

BINARY = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
DECIMAL = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
PLAIN = {"": 1, "B": 1}
ALL_UNITS = {**PLAIN, **DECIMAL, **BINARY}

# What a message must offer the user instead: the accepted forms.
REMEDY = "512MiB"


def exact(text: str, multiplier: int) -> int:
    """The exact byte count of a decimal string times a unit, rounded down."""
    return math.floor(Fraction(text) * multiplier)


# -- accepted forms -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1KiB", 1024),
        ("1MiB", 1_048_576),
        ("1GiB", 1_073_741_824),
        ("1TiB", 1_099_511_627_776),
        ("1KB", 1000),
        ("1MB", 1_000_000),
        ("1GB", 1_000_000_000),
        ("1TB", 1_000_000_000_000),
        ("1B", 1),
        ("1", 1),
        ("0", 0),
        ("0GiB", 0),
        ("512MiB", 536_870_912),
        ("2GiB", 2_147_483_648),
        ("16GiB", 17_179_869_184),
        ("256GiB", 274_877_906_944),
        ("3TB", 3_000_000_000_000),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 1_610_612_736),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1.0001KB", 1000),  # 1000.1 bytes, rounded down
        ("1.0B", 1),
        ("1e3", 1000),
        ("2E3KB", 2_000_000),
        ("123456", 123_456),
    ],
)
def test_string_forms(text: str, expected: int) -> None:
    result = parse_bytes(text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize("unit", list(ALL_UNITS))
def test_every_unit_is_its_power(unit: str) -> None:
    assert parse_bytes(f"7{unit}") == 7 * ALL_UNITS[unit]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2gib", 2 * 1024**3),
        ("2GIB", 2 * 1024**3),
        ("2gIb", 2 * 1024**3),
        ("3mb", 3_000_000),
        ("3Mb", 3_000_000),
        ("4b", 4),
        ("5kib", 5 * 1024),
        ("5tb", 5 * 1000**4),
    ],
)
def test_units_are_case_insensitive(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  2GiB", 2 * 1024**3),
        ("2GiB  ", 2 * 1024**3),
        ("2 GiB", 2 * 1024**3),
        ("\t2\tGiB\n", 2 * 1024**3),
        (" 1.5 GB ", 1_500_000_000),
        (" 42 ", 42),
    ],
)
def test_whitespace_around_number_and_unit(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value", [0, 1, 1023, 2**31, 2**40 + 7, 2**63 - 1])
def test_ints_pass_through_exactly(value: int) -> None:
    result = parse_bytes(value)
    assert result == value
    assert type(result) is int


@pytest.mark.parametrize(("value", "expected"), [(1.5e9, 1_500_000_000), (0.0, 0), (1024.0, 1024)])
def test_whole_floats_are_byte_counts(value: float, expected: int) -> None:
    result = parse_bytes(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(("value", "advice"), [
    (1.5, 'give a string with a unit, like "1.5GiB", or a whole number of bytes'),
    (2.9, 'like "2.9GiB"'),
    (np.float64(0.5), 'like "0.5GiB"'),
    (1288490188.8, "give a whole number of bytes, like int(1288490188.8) for a computed budget"),
    ("1.5B", 'is a fraction of a byte; give a larger unit, like "1.5GiB", or a whole number of bytes'),
    ("1.9999B", 'like "1.9999GiB"'),
    (" 0.5 b", 'like "0.5GiB"'),
])
def test_a_fraction_of_a_byte_is_refused_saying_what_to_write(value: object, advice: str) -> None:
    # Rounded down, 1.5 (meant as 1.5GiB) or "1.5B" (a G left off) was a budget of one byte:
    # every block evicted, a reopened store's included, and nothing said. Fractions of larger
    # units (107374182.4 bytes for "0.1GiB") still round down: a whole-ish count, as meant.
    with pytest.raises(ValueError, match=re.escape(advice)):
        parse_bytes(value, "disk_budget")


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(ALL_UNITS)))
def test_integer_strings_are_exact(n: int, unit: str) -> None:
    assert parse_bytes(f"{n}{unit}") == n * ALL_UNITS[unit]


@pytest.mark.parametrize("text", ["9007199254740993", "9223372036854775807", "9007199254740993B"])
def test_large_integer_strings_are_exact(text: str) -> None:
    # A string of digits is a whole number of bytes; going through a float loses the low digits
    # (2**53 + 1 is not a float64).
    assert parse_bytes(text) == int(text.removesuffix("B"))


@given(st.integers(min_value=2**27, max_value=2**32))
def test_odd_integer_strings_beyond_float_precision_are_exact(n: int) -> None:
    # Odd and above 2**57 (below the 2**63 cap): never a float64, so any float detour shows.
    big = n * 2**30 + 1
    assert parse_bytes(str(big)) == big


@example(2, 1, "KB")
@example(64, 10, "KB")
@given(
    st.integers(min_value=0, max_value=9999),
    st.integers(min_value=0, max_value=99),
    st.sampled_from(sorted(DECIMAL) + sorted(BINARY)),
)
def test_fractions_round_down_exactly(whole: int, hundredths: int, unit: str) -> None:
    text = f"{whole}.{hundredths:02d}"
    assert parse_bytes(text + unit) == exact(text, ALL_UNITS[unit])


@pytest.mark.parametrize(("text", "expected"), [("2.01KB", 2010), ("4.02KB", 4020), ("64.1KB", 64_100), ("8.03KB", 8030)])
def test_decimal_fractions_are_not_float_rounded(text: str, expected: int) -> None:
    # 2.01KB is exactly 2010 bytes; 2.01 * 1000 in binary floating point is 2009.9999999999998.
    assert parse_bytes(text) == expected


def test_name_appears_in_messages() -> None:
    with pytest.raises(ValueError, match="host_budget"):
        parse_bytes("12 parsecs", "host_budget")
    with pytest.raises(TypeError, match="disk_budget"):
        parse_bytes(None, "disk_budget")


# -- rejected forms -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["5XB", "5k", "5K", "5KiBs", "5 bytes", "5Gi", "5PB", "5PiB", "5iB", "1.5 GBB"])
def test_unknown_unit_raises_value_error_with_forms(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    message = str(info.value)
    assert "unit" in message
    assert REMEDY in message and "KiB/MiB/GiB/TiB" in message and "KB/MB/GB/TB" in message


@pytest.mark.parametrize("value", [-1, -(2**40)])
def test_negative_int_raises_with_remedy(value: int) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert type(info.value) is ValueError
    assert "negative" in str(info.value)
    assert "Use 0" in str(info.value)


@pytest.mark.parametrize("value", ["-1", "-1GiB", " -512MiB", "-1.5GB"])
def test_negative_string_raises_with_remedy(value: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert "negative" in str(info.value)
    assert "Use 0" in str(info.value)


@pytest.mark.parametrize("value", [-1.0, -0.5, -1.5e9 + 0.5])
def test_negative_float_raises_with_remedy(value: float) -> None:
    # A fraction too: not told to write it as a negative string with a unit ("-0.5GiB").
    with pytest.raises(ValueError, match="negative.*Use 0"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_a_type_error(value: bool) -> None:
    with pytest.raises(TypeError) as info:
        parse_bytes(value)
    assert "bool" in str(info.value)
    assert REMEDY in str(info.value)


@pytest.mark.parametrize("value", [None, b"1GiB", [1024], {"GiB": 1}, 1 + 2j, object()])
def test_other_types_are_type_errors(value: object) -> None:
    with pytest.raises(TypeError) as info:
        parse_bytes(value)
    assert REMEDY in str(info.value)
    assert type(value).__name__ in str(info.value)


@pytest.mark.parametrize("text", ["1.5", ".5", "0.1", "1023.5", "2.5e0"])
def test_a_fraction_without_a_unit_is_refused_as_a_unit_left_off(text: str) -> None:
    # "1.5" meant as 1.5GiB would be one byte: a reopened store would evict every block it holds.
    with pytest.raises(ValueError, match=f"disk_budget='{re.escape(text)}' is a fraction of a byte; give a unit"):
        parse_bytes(text, "disk_budget")


@pytest.mark.parametrize(
    "text",
    ["", " ", "GiB", "abc", "1.5.5GB", "1,000", "1_000", "0x10", "+5", "1 2 GiB", "2 G i B", "nan", "NaN", "inf",
     "-inf", "Infinity", "1e", "e3", ".", "1GiB!", "１GiB"],
)
def test_garbage_strings_raise_value_error_with_forms(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert type(info.value) is ValueError
    assert REMEDY in str(info.value) or "Use 0" in str(info.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_raise_value_error(value: float) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    assert "finite" in str(info.value)
    assert REMEDY in str(info.value)


@example("1e999")
@example("1e9999999999")
@given(st.text(max_size=12))
def test_arbitrary_text_is_a_count_or_a_value_error(text: str) -> None:
    try:
        result = parse_bytes(text)
    except ValueError as exc:
        assert REMEDY in str(exc) or "Use 0" in str(exc)
    else:
        assert type(result) is int and result >= 0


@pytest.mark.parametrize("text", ["1e999", "1e400GB", "1e308TiB", 2**63, 10**30,
                                  "1e9999999999", "1e99999999999KiB"])  # past Decimal's exponents
def test_overflowing_exponent_is_a_value_error(text: str) -> None:
    # float("1e999") is inf; int(inf) raises OverflowError, which callers do not expect.
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert REMEDY in str(info.value) or "finite" in str(info.value)


# -- numpy's scalars ------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    (np.int64(2**40), 2**40), (np.uint64(2**63 - 1), 2**63 - 1), (np.int32(7), 7), (np.float32(1.5e6), 1_500_000),
    (np.float64(3.0), 3),
])
def test_numpy_scalars_are_byte_counts(value: object, expected: int) -> None:
    assert parse_bytes(value) == expected and type(parse_bytes(value)) is int


@pytest.mark.parametrize(("value", "error"), [
    (np.int64(-1), ValueError), (np.float64("nan"), ValueError), (np.float32("inf"), ValueError),
    (np.uint64(2**64 - 1), ValueError), (np.bool_(True), TypeError), (np.array([5]), TypeError),
])
def test_bad_numpy_values_are_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="budget"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [5, np.int64(5), np.uint8(5)])
def test_whole_numbers_take_numpy_integers(value: object) -> None:
    assert whole_number(value, "n", 1) == 5 and type(whole_number(value, "n", 1)) is int


@pytest.mark.parametrize(("value", "error"), [
    (0, ValueError), (np.int64(-3), ValueError), (True, TypeError), (np.bool_(True), TypeError), (5.0, TypeError),
    ("5", TypeError), (None, TypeError),
])
def test_whole_numbers_refuse_the_rest_naming_the_argument(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="block_size .*; 256 is a good default"):
        whole_number(value, "block_size", 1, "; 256 is a good default")


def test_whole_numbers_take_both_bounds_and_refuse_one_past_either() -> None:
    # Nothing held the bounds inclusive: a minimum refused at itself (port=0, block_size=1) passed.
    assert whole_number(1, "n", 1) == 1 and whole_number(8, "n", 1, maximum=8) == 8
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        whole_number(0, "n", 1)
    with pytest.raises(ValueError, match="n must be <= 8, got 9"):
        whole_number(9, "n", 1, maximum=8)


@pytest.mark.parametrize(("value", "expected"), [(None, None), (math.inf, None), (0, 0.0), (2, 2.0), (np.float32(0.5), 0.5)])
def test_a_timeout_is_seconds_or_none_and_infinity_is_none(value: object, expected: float | None) -> None:
    # inf is None's "as long as it takes" (the docstring's word): kept as inf, close(timeout=inf)
    # took the timed path, skipping the flush None's close runs first; nothing checked it.
    assert seconds_or_none(value, "timeout") == expected


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (math.nan, ValueError), (True, TypeError), ("5", TypeError)])
def test_a_bad_timeout_is_refused_naming_it(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout"):
        seconds_or_none(value, "timeout")


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                         (1 << 30, "1.0 GiB"), (1 << 50, "1024.0 TiB")])
def test_byte_counts_are_written_in_the_largest_power_of_1024_they_reach(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(("path", "spelled"), [
    ("/srv/kv", "/srv/kv"), ("/srv/my kv", "'/srv/my kv'"), ("/srv/it's", "'/srv/it'\"'\"'s'"),
    ("-kv", "./-kv"), ("-my kv", "'./-my kv'"),
])
def test_shell_path_spells_a_path_as_a_shell_reads_it_back(path, spelled):
    # A command in a message is run as printed: quoted, and a path read as an option led by ./
    assert shell_path(path) == spelled
    argument = f"./{path}" if path.startswith("-") else path
    assert shlex.split(f"tierkv check {shell_path(path)} --repair") == ["tierkv", "check", argument, "--repair"]
