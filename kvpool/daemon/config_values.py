"""Checks of single configuration values: which sizes may be percentages or page
counts, the page size rule, log levels, non-empty names, and how problems are shown.
Pure functions over already well-typed values (:mod:`kvpool.daemon.config` converts
them with msgspec first); each returns one human line or None."""

from __future__ import annotations

import grp
from typing import Any

import msgspec

from kvpool.discovery import address_problem, namespace_problem
from kvpool.sizes import format_size, parse_size
from kvpool.daemon.policy import POLICIES
from kvpool.vmm.registry import BACKENDS, capabilities

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_BYTES = 1 << 62

# which sizes may be a percentage, a page count ("16p"), must be > 0
SIZE_RULES = {
    "budget": dict(percent=True, pages=False, positive=True),
    "page_size": dict(percent=False, pages=False, positive=True),
    "warm_min": dict(percent=True, pages=True, positive=False),
    "warm_max": dict(percent=True, pages=True, positive=False),
    "default_max": dict(percent=True, pages=False, positive=True),
    "min": dict(percent=True, pages=False, positive=False),
    "max": dict(percent=True, pages=False, positive=True),
}


def normalise(key: str, value: Any) -> Any:
    if key == "devices" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # devices = 2 in TOML: a count
    if key == "socket_mode" and isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if text and all(c in "01234567" for c in text):
            return int(text, 8)
    if key == "log_level" and isinstance(value, str):
        return value.upper()
    return value


def check_value(key: str, value: Any) -> str | None:
    """What is wrong with an already well-typed value, or None."""
    if key == "page_size" and value is not None:
        return check_size(value, **SIZE_RULES[key]) or _page_size_problem(parse_size(value))
    if key in SIZE_RULES and value is not None:
        return check_size(value, **SIZE_RULES[key])
    if key == "device_budgets":
        for device, size in value.items():
            why = check_size(size, **SIZE_RULES["budget"])
            if why:
                return f"device {device}: {why}"
    if key == "log_level" and value not in LOG_LEVELS:
        return f"expected one of {', '.join(LOG_LEVELS)}"
    if key == "reclaim_policy" and value not in POLICIES:
        return f"expected one of {', '.join(POLICIES.names())}"
    if key == "backend" and value not in BACKENDS:
        return f"expected one of {', '.join(BACKENDS)}"
    if key in ("run_dir", "socket_group", "admin_group", "endpoints_file") and \
            value is not None and not value:
        return "must not be empty"
    if key == "endpoints_file" and value is not None and "\0" in value:
        return "must not hold a NUL character"
    if key == "endpoints_address" and value is not None:
        return address_problem(value)
    if key == "endpoints_namespace":
        return namespace_problem(value)
    return None


def check_size(value: int | str, *, percent: bool, pages: bool, positive: bool) -> str | None:
    """Why ``value`` is not a valid size of this kind, or None (a percentage's total is
    known only later)."""
    text = value.strip() if isinstance(value, str) else None
    if pages and text and text.endswith("p") and text[:-1].isdigit():
        return None
    if text is not None and text.endswith("%") and not percent:
        return "a percentage is not allowed here"
    try:
        n = parse_size(value, 1 << 40 if percent else None)  # a share of 1 TiB, for the check
    except ValueError as e:
        return str(e)
    if n > MAX_BYTES:
        return "too large"
    if positive and n == 0:
        return "must be more than 0"
    return None


def _page_size_problem(n: int) -> str | None:
    if n < 4096 or n & (n - 1):
        return "expected a power of two of at least 4 KiB"
    return None


def huge_pages_problem(backend: str, page_size: int | str | None) -> str | None:
    """Why ``huge_pages = true`` cannot work with this backend and page size, or None."""
    from kvpool.vmm import hugetlb
    from kvpool.vmm.host import DEFAULT_PAGE_SIZE

    if backend != "auto" and not capabilities(backend).huge_pages:
        return f"hugetlb backs host pages only (the {backend} backend cannot use it)"
    size = parse_size(page_size) if page_size is not None else DEFAULT_PAGE_SIZE
    huge = hugetlb.huge_page_size()
    if huge is None:
        return "this kernel has no hugetlb support (no Hugepagesize in /proc/meminfo)"
    if size % huge:
        return (f"page_size {format_size(size)} is not a multiple of the huge page size "
                f"{format_size(huge)}")
    return None


def no_huge_pages(page_size: int, total: int) -> str:
    return (f"huge_pages = true: the hugetlb pool holds {format_size(total)}, less than one "
            f"{format_size(page_size)} page; reserve huge pages first (sysctl "
            f"vm.nr_hugepages=N, or the hugepages=N kernel argument)")


def few_huge_pages(warm: int, page_size: int, free: int) -> str:
    return (f"huge_pages = true: {format_size(free)} of huge pages free (HugePages_Free), "
            f"the daemon must pre-create {warm} pages of {format_size(page_size)} "
            f"(warm_min); free huge pages or raise vm.nr_hugepages")


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def reason(e: msgspec.ValidationError) -> str:
    text = str(e).replace("`", "")
    return text[:1].lower() + text[1:]


def show(value: Any) -> str:
    return repr(value) if not isinstance(value, float) else f"{value:g}"


def show_size(value: int | str) -> str:
    return format_size(value) if isinstance(value, int) else repr(value)
