"""Sizes and durations as the logs, the status table and the report print them."""

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
