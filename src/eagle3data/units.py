"""Sizes, counts and durations as the logs, the status table and the report print them,
and counts as people type them (``eagle3data-status --budget B2=10M``)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Decimal units, one decimal: ``57.3 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def duration(seconds: float | None) -> str:
    """``-`` when unknown, else minutes and seconds (``3m05s``) or hours and minutes
    (``26h40m``)."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def human_count(n: int) -> str:
    """Exact below 100000, else three significant digits and k, M, G or T (``21.8M``)."""
    if abs(n) < 100_000:
        return str(n)
    for unit, scale in (("k", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12)):
        value = n / scale
        if abs(value) < 999.5 or unit == "T":
            return f"{value:.3g}{unit}"
    raise AssertionError("unreachable")


_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A count as people type it: ``7000``, ``7_000``, ``10M``, ``2.5k`` (k, M, G, T in
    any case; decimal multiples)."""
    clean = text.strip().replace("_", "").replace(",", "")
    scale = _COUNT_SUFFIXES.get(clean[-1:].lower(), 1)
    number = clean[:-1] if scale != 1 else clean
    try:
        value = float(number) * scale if "." in number else int(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a count (e.g. 7000, 10M, 2.5k)") from None
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole count")
    return int(value)
