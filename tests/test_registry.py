"""The one registry type (kvpool/registry.py, issue 35 item 6): the five registries are
instances of it, an unknown name is one line naming the known ones, and what a
configuration offers is the registry's names, not a copy."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.daemon.policy import POLICIES
from kvpool.fleet.balance import PICKERS
from kvpool.fleet.engines import KINDS
from kvpool.fleet.policies import FLEET_POLICIES
from kvpool.registry import Registry, UnknownName
from kvpool.vmm.registry import BACKENDS, REGISTRY


def test_the_five_registries_are_one_type() -> None:
    for registry in (REGISTRY, POLICIES, KINDS, PICKERS, FLEET_POLICIES):
        assert isinstance(registry, Registry)
        assert list(registry) == list(registry.names()) and len(registry) > 1
        for name in registry.names():
            assert registry.lookup(name) is registry.entries()[registry.names().index(name)]


@pytest.mark.parametrize("hostile", ["nope", "", "x" * 10_000, ["a"], {"k": 1}, None])
def test_an_unknown_name_is_one_line_naming_the_known_ones(hostile: object) -> None:
    for registry in (REGISTRY, POLICIES, KINDS, PICKERS, FLEET_POLICIES):
        assert hostile not in registry
        with pytest.raises(UnknownName) as e:
            registry.lookup(hostile)  # type: ignore[arg-type]
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"unknown {registry.what} ")
        assert text.endswith(f"(one of {', '.join(registry.names())})")


def test_a_name_is_registered_once() -> None:
    r: Registry[int] = Registry("thing")
    assert r.register("a", 1) == 1
    with pytest.raises(ValueError, match="registered twice"):
        r.register("a", 2)
    with pytest.raises(ValueError):
        r.register("", 3)
    assert r.names() == ("a",) and r.lookup("a") == 1


def test_the_cli_offers_the_registry_s_backends() -> None:
    assert BACKENDS == ("auto", *REGISTRY.names())
    for command in (["daemon"], ["info"]):
        r = CliRunner().invoke(cli, [*command, "--backend", "tpu"])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert all(f"'{name}'" in r.output for name in BACKENDS), r.output


def test_the_daemon_config_asks_the_registries() -> None:
    from kvpool.daemon.config import Config, ConfigError

    with pytest.raises(ConfigError) as e:
        Config.from_dict({"backend": "gpu", "reclaim_policy": "lottery"})
    assert sorted(e.value.problems) == [
        f"backend = 'gpu': expected one of {', '.join(BACKENDS)}",
        f"reclaim_policy = 'lottery': expected one of {', '.join(POLICIES.names())}"]
    assert Config.from_dict({"backend": REGISTRY.names()[-1]}).backend == REGISTRY.names()[-1]
