"""Who may use a server's control routes (``POST /sleep``, ``POST /wake_up`` of ``kvpool
serve --elastic``): the bearer token of ``KVPOOL_CONTROL_TOKEN`` (or the file named by
``KVPOOL_CONTROL_TOKEN_FILE``, e.g. a Kubernetes Secret mounted read-only).

* A token is configured: every control request must carry ``Authorization: Bearer
  TOKEN`` (401 without one, 403 with another), whatever address the server listens on.
* None is configured: the routes answer only a server that listens on a loopback
  address (127.0.0.0/8, ::1, ``localhost``), where only this host's processes reach
  them; a server listening anywhere else refuses them (403, saying what to set). The
  peer's address is not the test: a proxy on the host (a service mesh's sidecar) makes
  every remote caller look local.

A client of the routes (the fleet) sends :func:`headers` of the same environment. Bad
configuration (both variables, an unreadable file, a token shorter than
:data:`MIN_LENGTH` or with spaces or control characters) is one line
(:class:`ControlTokenError`) before the server starts. Serving routes are untouched.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TOKEN_VAR, FILE_VAR = "KVPOOL_CONTROL_TOKEN", "KVPOOL_CONTROL_TOKEN_FILE"
MIN_LENGTH = 16  # bytes of printable ASCII: a guessable token protects nothing
MAX_LENGTH = 4096


class ControlTokenError(RuntimeError):
    """The token's configuration is unusable (one line)."""


def load(env: Mapping[str, str]) -> str | None:
    """The configured token, or None; :class:`ControlTokenError` when it is unusable."""
    value, path = env.get(TOKEN_VAR), env.get(FILE_VAR)
    if value is not None and path is not None:
        raise ControlTokenError(f"set {TOKEN_VAR} or {FILE_VAR}, not both")
    if path is not None:
        try:
            with open(Path(path), "rb") as f:
                raw = f.read(MAX_LENGTH + 2)
        except OSError as e:
            raise ControlTokenError(f"{FILE_VAR}: cannot read {path!r}: "
                                    f"{e.strerror or e}") from None
        try:
            value = raw.decode("ascii").removesuffix("\n").removesuffix("\r")
        except UnicodeDecodeError:
            raise ControlTokenError(f"{FILE_VAR}: {path!r} is not ASCII text") from None
    if value is None:
        return None
    where = TOKEN_VAR if path is None else f"{FILE_VAR} ({path!r})"
    if not MIN_LENGTH <= len(value) <= MAX_LENGTH:
        raise ControlTokenError(f"{where}: a token of {MIN_LENGTH} to {MAX_LENGTH} "
                                f"characters is needed, got {len(value)}")
    if not all("!" <= ch <= "~" for ch in value):
        raise ControlTokenError(f"{where}: the token must be printable ASCII without "
                                f"spaces")
    return value


def headers(env: Mapping[str, str]) -> dict[str, str]:
    """What a client of the control routes sends: the bearer token of ``env``, if any."""
    token = load(env)
    return {"Authorization": f"Bearer {token}"} if token is not None else {}


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from this host alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or anything else): it may resolve to any interface


@dataclass(frozen=True)
class ControlGate:
    """The check of one server: its token (None: none configured) and the address it
    listens on."""

    token: str | None
    host: str

    @classmethod
    def of(cls, host: str, env: Mapping[str, str]) -> ControlGate:
        """The gate for a server on ``host`` configured by ``env`` (raises
        :class:`ControlTokenError`)."""
        return cls(load(env), host)

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """None when a control request with this ``Authorization`` header (None: none)
        may proceed, else its status (401, 403) and one line saying why."""
        if self.token is None:
            if is_loopback(self.host):
                return None
            return 403, (f"control routes are off: this server listens on {self.host} "
                         f"without {TOKEN_VAR} (set it, or listen on 127.0.0.1)")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return 401, f"control route: send Authorization: Bearer <{TOKEN_VAR}>"
        if not hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                   self.token.encode()):
            return 403, "control route: wrong token"
        return None
