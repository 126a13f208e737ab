"""The systemd unit lets the optional exporter listen on loopback, and only there."""

from __future__ import annotations

import tomllib

from daemon.helpers import REPO

from kvpool.daemon.config import Config


def test_unit_allows_inet_sockets_to_localhost_only():
    unit = (REPO / "systemd" / "kvpool.service").read_text().splitlines()
    families = [x for x in unit if x.startswith("RestrictAddressFamilies=")]
    assert families == ["RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6"]
    assert "IPAddressAllow=localhost" in unit and "IPAddressDeny=any" in unit


def test_shipped_config_names_a_loopback_metrics_address():
    text = (REPO / "systemd" / "kvpool.toml").read_text()
    line = next(x for x in text.splitlines() if "metrics_address" in x and "=" in x)
    values = tomllib.loads(line.lstrip("# "))
    cfg = Config.from_dict(values)
    from kvpool.daemon.metrics import parse_address

    assert parse_address(cfg.metrics_address) == ("127.0.0.1", 9400)
