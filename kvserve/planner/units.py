"""Units the planner reads and prints.

Sizes print in both binary and decimal units, because vendors and articles mix them: a "GB" on a
datasheet is usually 10^9 bytes, a driver reports MiB, and some articles divide by 1.024e9 (MiB /
1000). Every figure is also kept as an exact byte count in the JSON output.
"""

from __future__ import annotations

import re

from kvserve.config import parse_size

GIB = 2**30
GB = 10**9
# The unit of the first background article's table (bytes / 1.024e9, i.e. MiB / 1000).
ARTICLE_GB = 1.024e9


def gib(n: float) -> float:
    return n / GIB


def fmt_bytes(n: float) -> str:
    """``2.00 GiB (2.15 GB)`` for large counts, ``128.0 KiB (131.1 kB)`` for small ones."""
    if abs(n) >= 2**30:
        return f"{n / GIB:,.2f} GiB ({n / GB:,.2f} GB)"
    if abs(n) >= 2**20:
        return f"{n / 2**20:,.1f} MiB ({n / 10**6:,.1f} MB)"
    if abs(n) >= 2**10:
        return f"{n / 2**10:,.1f} KiB ({n / 10**3:,.1f} kB)"
    return f"{n:,.0f} B"


def fmt_tokens(n: int) -> str:
    """``4K`` for 4096 and ``128K`` for 131072 (powers of two), ``128,000`` for anything else."""
    if n >= 1024 and n & (n - 1) == 0:
        return f"{n // 1024}K"
    return f"{n:,}"


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def parse_positive_int(name: str, value: str | int) -> int:
    """An integer > 0; the message names the option."""
    try:
        n = int(str(value).replace("_", "").replace(",", ""))
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"{name} must be > 0, got {n}")
    return n


def parse_tokens(name: str, value: str | int) -> int:
    """A token count: ``4096``, ``4K`` (= 4096), ``128k`` (= 131072), ``128000``."""
    text = str(value).strip()
    if text[-1:] in ("k", "K"):
        return parse_positive_int(name, text[:-1]) * 1024
    return parse_positive_int(name, text)


def parse_fraction(name: str, value: str | float, *, allow_zero: bool = False) -> float:
    """A fraction in (0, 1] (or [0, 1) with ``allow_zero``): ``0.9`` or ``90%``."""
    text = str(value).strip()
    try:
        f = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number like 0.9 or 90%, got {value!r}") from None
    if allow_zero:
        if not 0.0 <= f < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    elif not 0.0 < f <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return f


def parse_memory(name: str, value: str | int) -> int:
    """Bytes from ``80GiB``, ``141GB`` (10^9), ``512MiB`` or a byte count, > 0."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B)?\s*(/s)?\s*$", re.IGNORECASE)


def parse_bandwidth(name: str, value: str | float) -> float:
    """Bytes/s from ``3350`` (GB/s, as datasheets print it), ``3.35TB/s``, ``800GB/s``, ``60GiB/s``."""
    m = _BW_RE.match(str(value))
    if not m:
        raise ValueError(f"{name} must look like 3350 (GB/s), 3.35TB/s or 60GiB/s, got {value!r}")
    number = float(m.group(1))
    unit = m.group(2)
    bps = number * 1e9 if unit is None else float(parse_size(f"1{unit}")) * number
    if bps <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return bps


def parse_positive_float(name: str, value: str | float) -> float:
    try:
        f = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if f <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return f
