"""Process limits every kvpool process needs (no daemon, no torch imports).

Host pages are file descriptors: the daemon holds one per page and a tenant one per
mapped page while it maps them, so both raise their open-file limit to the hard limit.
"""

from __future__ import annotations

import contextlib
import resource


def raise_fd_limit(want: int | None = None) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to ``want`` (default: the hard limit), never
    above the hard limit and never lowering it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if want is None else min(max(want, soft), hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
