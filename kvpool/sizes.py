"""Human sizes: ``512MiB``, ``2G``, ``1.5GiB``, ``30%`` (of a total), plain byte counts."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*|%)\s*$")


def parse_size(text: str | int, total: int | None = None) -> int:
    """Bytes for ``text``. Bare letters are binary (``2G`` = 2 GiB); ``KB/MB/GB`` are
    decimal; ``N%`` needs ``total``. A fraction of a byte (``0.5``) is refused, not
    truncated. Raises ValueError naming the bad input."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    m = _PATTERN.match(str(text))
    if not m:
        raise ValueError(
            f"cannot parse size {text!r}: expected a number with an optional unit "
            f"(B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB) or a percentage like 30%"
        )
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if total is None:
            raise ValueError(f"size {text!r} is a percentage, but there is no total to take it of")
        if number > 100:
            raise ValueError(f"size {text!r} is more than 100%")
        return int(total * number / 100)
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {m.group(2)!r} in {text!r}")
    if _UNITS[unit] == 1 and number != int(number):
        raise ValueError(f"size {text!r} is a fraction of a byte: give a unit (e.g. "
                         f"{m.group(1)}GiB) or a share (e.g. 50%)")
    return int(number * _UNITS[unit])


def format_size(n: int | float) -> str:
    """Short binary rendering: ``1.5 GiB``, ``64 KiB``, ``0 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
