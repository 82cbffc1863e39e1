"""How quantities read, one way everywhere: byte sizes and durations."""
from __future__ import annotations


def size(n: float, *, whole_bytes: bool = True) -> str:
    """`512 B`, `12.3 kB`, `4.5 MB`; without `whole_bytes` a small size reads in kB too
    (`0.5 kB`), as a line of sums (what shipped) does."""
    if whole_bytes and n < 1000:
        return f"{n} B"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def duration(seconds: float | None, *, tenths: bool = False) -> str:
    """`2h05m` from an hour up, else `4m07s`; with `tenths`, under a minute `12.3s`; None: `-`."""
    if seconds is None:
        return "-"
    if tenths and seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
