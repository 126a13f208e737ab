"""Which metrics addresses the daemon accepts: loopback, or anything when allowed."""

from __future__ import annotations

import pytest

from kvpool.daemon.metrics import AddressError, parse_address


@pytest.mark.parametrize("text, want", [("127.0.0.1:9400", ("127.0.0.1", 9400)),
                                        ("localhost:0", ("127.0.0.1", 0)),
                                        ("[::1]:9400", ("::1", 9400)),
                                        ("127.0.0.2:1", ("127.0.0.2", 1))])
def test_loopback_is_accepted(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["0.0.0.0:9400", "[::]:9400", "192.0.2.1:9400"])
def test_other_addresses_need_allow_remote(text):
    with pytest.raises(AddressError, match="not loopback"):
        parse_address(text)
    assert parse_address(text, allow_remote=True)[1] == 9400


@pytest.mark.parametrize("text", ["9400", ":9400", "127.0.0.1:x", "127.0.0.1:70000",
                                  "example.org:9400"])
def test_bad_addresses_say_why(text):
    with pytest.raises(AddressError, match="metrics address"):
        parse_address(text, allow_remote=True)
