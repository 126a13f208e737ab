"""``kvpool info``: which backend this machine gets and what memory it has."""

from __future__ import annotations

import json

import click

from kvpool.vmm.registry import BACKENDS


@click.command()
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--device", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def info(backend: str, device: int, as_json: bool) -> None:
    """Show the memory backend, its page sizes and the device's free/total memory."""
    from kvpool.sizes import format_size
    from kvpool.vmm import VmmError, open_backend
    from kvpool.vmm.cuda import probe

    try:
        b = open_backend(backend, device=device)
    except VmmError as e:
        raise click.ClickException(str(e)) from e
    free, total = b.mem_info()
    doc = {
        "backend": b.name,
        "device": device,
        "min_page_size": b.min_page_size(),
        "page_size": b.page_size,
        "free": free,
        "total": total,
        "cuda": probe(device) or "usable",
    }
    if as_json:
        click.echo(json.dumps(doc))
        return
    for key, value in doc.items():
        if key in ("min_page_size", "page_size", "free", "total") and isinstance(value, int):
            value = format_size(value)
        click.echo(f"{key:13} {value}")


def register(cli: click.Group) -> None:
    cli.add_command(info)
