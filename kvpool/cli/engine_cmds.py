"""Commands registered on the ``kvpool`` group (filled in by their owners)."""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    pass
