from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvpool.sizes import format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("512MiB", 512 << 20), ("2G", 2 << 30), ("2GiB", 2 << 30), ("1GB", 10**9), ("4096", 4096),
     ("1.5 KiB", 1536), ("64k", 65536), (123, 123)],
)
def test_parse(text, expected):
    assert parse_size(text) == expected


def test_percent_needs_total():
    assert parse_size("30%", total=1000) == 300
    with pytest.raises(ValueError, match="no total"):
        parse_size("30%")
    with pytest.raises(ValueError, match="more than 100%"):
        parse_size("130%", total=10)


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5MiB", "1e9", "MiB", "5%%"])
def test_bad_sizes_have_clear_errors(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["0.5", "2.25", "1.5B", " 0.5 b"])
def test_a_fraction_of_a_byte_is_refused(bad):
    """Issue 33 item 12: ``kvpool limit t1 0.5`` set 0 bytes (truncated); a bare
    fraction has no sensible meaning in bytes, so it is refused, naming the way out."""
    with pytest.raises(ValueError, match="fraction of a byte.*unit.*%"):
        parse_size(bad)
    assert parse_size("0.5KiB") == 512 and parse_size("1.0") == 1


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_then_parse_is_close(n):
    assert abs(parse_size(format_size(n).replace(" ", "")) - n) <= max(1, n * 0.05)
