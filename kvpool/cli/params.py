"""Click parameter types and options the commands share."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvpool.renames import both_line, deprecated_line, say
from kvpool.sizes import parse_size

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:  # generic from click 8.2 on; the project allows click 8.1
    _SizeParamBase = click.ParamType[int | str, Any]
else:
    _SizeParamBase = click.ParamType


class SizeParam(_SizeParamBase):
    """A size (``512MiB``, ``2G``, bytes) or, when ``percent`` is allowed, ``30%``."""

    name = "size"

    def __init__(self, percent: bool = False):
        self.percent = percent

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int | str:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            if text.endswith("%"):
                if not self.percent:
                    raise ValueError(f"{text!r}: a percentage is not allowed here")
                parse_size(text, 100)  # validate now, resolve against the device later
                return text
            return parse_size(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)


run_dir_option = click.option(
    "--run-dir", type=click.Path(file_okay=False), default=None,
    help="Daemon run directory (default: $KVPOOL_RUN_DIR, /run/kvpool, "
         "$XDG_RUNTIME_DIR/kvpool or /tmp/kvpool-$UID).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
DEVICE_KEY = "kvpool.device"  # where --device leaves its value (click context meta)


def _keep_device(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    ctx.meta[DEVICE_KEY] = value


# the device a monitor command reads (a daemon serving several; default: its first);
# kept in the context for the command's monitor session (kvpool.cli.monitor)
device_option = click.option(
    "--device", type=click.IntRange(min=0, max=1024), default=None, expose_value=False,
    callback=_keep_device, help="The device to show (a daemon with --devices; default: "
                                "its first).")


def shares_options(help: str, type: Any = None) -> Callable[[F], F]:
    """``--shares N`` (the command's ``shares`` parameter) and ``--weight``, its old name
    (hidden, the ``old_weight`` parameter; accepted for one release): pass both to
    :func:`chosen_shares`."""
    def add(f: F) -> F:
        f = click.option("--weight", "old_weight", type=type, default=None, hidden=True,
                         help="Deprecated: the old name of --shares.")(f)
        return click.option("--shares", type=type, default=None, metavar="N", help=help)(f)
    return add


def chosen_shares(shares: Any, old_weight: Any) -> Any:
    """The value of ``--shares``, or of ``--weight`` (its deprecation line said on
    stderr); both given: one line on stderr, exit status 2."""
    if old_weight is None:
        return shares
    if shares is not None:
        click.echo(f"Error: {both_line('--weight', '--shares')}", err=True)
        sys.exit(2)
    say(deprecated_line("--weight", "--shares"))
    return old_weight
