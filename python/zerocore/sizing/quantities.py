"""Counts and byte sizes as people write them (7.5B params, 80GB, 80GiB),
parsed and formatted for zerocore.estimate and its command; EstimateError,
the error of everything in sizing/."""
import decimal
import math
import re

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class EstimateError(ValueError):
    """A model or a size that cannot be estimated; the message says why."""


def _decimal(text: str, what: str) -> decimal.Decimal:
    try:
        value = decimal.Decimal(text.replace("_", "").replace(",", ""))
    except decimal.InvalidOperation:
        raise EstimateError(f"{what}: {text!r} is not a number") from None
    if not value.is_finite() or value < 0:
        raise EstimateError(f"{what}: {text!r} is not a non-negative number")
    return value


def parse_count(text) -> int:
    """A param count: 7500000000, "7.5B", "125M", "350K", "1.3e9"."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([\d_.,eE+]+)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise EstimateError(f"{text!r} is not a param count (use 7500000000, 7.5B, 125M or 350K)")
    return int(_decimal(m.group(1), "param count") * _COUNT_SUFFIX[m.group(2).upper()])


def parse_bytes(text) -> int:
    """A memory size with its unit: "80GB", "80 GiB", "512MiB", "1.5TB", "4096B"
    (KB, MB, GB, TB are powers of 10; KiB, MiB, GiB, TiB of 2). An int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([\d_.,eE+]+)\s*([A-Za-z]+)\s*", str(text))
    unit = m and {u.lower(): u for u in UNITS}.get(m.group(2).lower())
    if not unit:
        raise EstimateError(f"{text!r} is not a memory size; give a number and a unit: "
                            f"{', '.join(UNITS)} (80GB, 80GiB)")
    return int(_decimal(m.group(1), "memory") * UNITS[unit])


def format_bytes(n, unit: str = "GB") -> str:
    """n bytes in `unit`, to 3 significant figures (the ZeRO paper's style;
    at least the whole units): 120, 31.4, 1.88, 0.0312."""
    if unit == "B":
        return f"{int(n):,}"
    v = n / UNITS[unit]
    if v >= 100 or v == 0:
        return f"{v:,.0f}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(v)))}f}"


def auto_unit(n) -> str:
    """The largest decimal unit in which n bytes are 1 or more."""
    return next((u for u in ("TB", "GB", "MB", "KB") if n >= UNITS[u]), "B")


def format_count(n) -> str:
    """7,500,000,000 (7.5B)."""
    if n == math.inf:
        return "no limit"
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.3g}{suffix})"
    return f"{n:,}"


def unit_name(unit: str) -> str:
    """GB (10^9 bytes), GiB (2^30 bytes)."""
    if unit == "B":
        return "bytes"
    n = UNITS[unit]
    return f"{unit} (2^{n.bit_length() - 1} bytes)" if unit.endswith("iB") else f"{unit} (10^{len(str(n)) - 1} bytes)"
