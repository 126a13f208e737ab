"""``Register.group`` (a fleet's name, ``KVPOOL_GROUP``): carried to ``ps`` (``group`` in
``--json``, a FLEET column in the table); a hostile group is refused like a bad name."""

from __future__ import annotations

import pytest

from kvpool.client_lib import KvpoolError


def test_the_group_shows_in_ps(start_daemon) -> None:
    d = start_daemon()
    with d.connect("member", group="fleet-1"), d.connect("loner"):
        rows = {t["name"]: t for t in d.cli_json("ps")["tenants"]}
        assert (rows["member"]["group"], rows["loner"]["group"]) == ("fleet-1", "")
        out = d.cli("ps").stdout
        assert "FLEET" in out and "fleet-1" in out, out
    out = d.cli("ps").stdout
    assert "FLEET" not in out  # no column when no tenant says a group


def test_a_bad_group_is_refused(start_daemon) -> None:
    d = start_daemon()
    for group in ("two words", "x" * 65, "", "a/b", "\x00"):
        with pytest.raises(KvpoolError) as e:
            d.connect("member", group=group)
        assert e.value.code == "BAD_REQUEST" and "\n" not in str(e.value), group
    with d.connect("member", group="ok"):  # the name was not taken by a refused one
        pass
    assert d.check() == []
