"""What the chart must guarantee, on the default values and every example values file;
each property is also checked against a copy of the chart with that property broken, so
a check that cannot fail would show here."""

from __future__ import annotations

import dataclasses
import grp
import os
from pathlib import Path
from typing import Any

import pytest

from kvpool.daemon.config import Config, ConfigError

from .chart import (ALL_TENANTS, EXAMPLES, Obj, broken_chart, check_daemon_not_root,
                    check_one_daemon_per_node, check_probes_call_daemon, check_socket_dir,
                    check_socket_group, config_toml, render, tomllib, values_of)

CASES = [None, *EXAMPLES]
IDS = ["defaults", *(p.stem for p in EXAMPLES)]


def run_dir_of(values: dict[str, Any]) -> str:
    return str(values.get("runDir", "/run/kvpool"))


def with_tenants(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every example tenant on (in dra.mode=consumable, with a claim)."""
    out = {**values, **{k: {**values.get(k, {}), **v} for k, v in ALL_TENANTS.items()}}
    if values.get("dra", {}).get("mode") == "consumable":
        for key, field in (("vllm", "min"), ("server", "min"), ("training", "lease")):
            if field not in values.get(key, {}):
                out[key] = {**out[key], field: "1Gi"}
    return out


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_properties_hold(path: Path | None) -> None:
    values = with_tenants(values_of(path))
    objs = render(values)
    check_socket_dir(objs, run_dir_of(values))
    check_socket_group(objs)
    check_daemon_not_root(objs, root_allowed=False)
    check_one_daemon_per_node(objs)
    check_probes_call_daemon(objs, run_dir_of(values))


def test_values_move_the_socket_dir_and_the_daemon_user_everywhere() -> None:
    values = with_tenants({"runDir": "/var/run/kvpool-a", "daemon": {"uid": 5000, "gid": 5001}})
    objs = render(values)
    check_socket_dir(objs, "/var/run/kvpool-a")
    check_socket_group(objs)
    check_probes_call_daemon(objs, "/var/run/kvpool-a")


def test_root_only_when_a_value_says_so() -> None:
    objs = render({"daemon": {"runAsRoot": True}})
    with pytest.raises(AssertionError, match="uid 0"):
        check_daemon_not_root(objs, root_allowed=False)
    check_daemon_not_root(objs, root_allowed=True)
    check_socket_group(render(with_tenants({"daemon": {"runAsRoot": True}})))


# ---- each property broken once in a copy of the chart -----------------------------------
BREAKS = {
    # property: (template, text, replacement, what the failing check must say)
    "socket_dir": ("_helpers.tpl", "  mountPath: {{ .Values.runDir }}\n  readOnly: true",
                   "  mountPath: /var/run/kvpool\n  readOnly: true",
                   "does not mount /run/kvpool at /run/kvpool"),
    "socket_group": ("_helpers.tpl", "supplementalGroups: [{{ .Values.daemon.gid | int }}]",
                     "supplementalGroups: []", "not in the socket group 64001"),
    "not_root": ("daemonset.yaml", "runAsUser: {{ $d.uid | int }}", "runAsUser: 0",
                 "daemon runs as uid 0"),
    "one_per_node": ("daemonset.yaml", "maxSurge: 0", "maxSurge: 1", "two daemons on a node"),
    "probes": ("_helpers.tpl", "--run-dir, {{ .root.Values.runDir | quote }}",
               "--run-dir, /tmp/kvpool", "Probe: .*/tmp/kvpool"),
    # whole numbers written as Go floats (1.04858e+06): the daemon refuses them
    "config_knob": ("_helpers.tpl", "{{- if eq (float64 (int64 .)) (float64 .) -}}{{ int64 . }}",
                    "{{- if eq (float64 (int64 .)) (float64 .) -}}{{ . }}",
                    "max_virtual_pages_per_tenant = 1.04858e\\+06: expected int"),
    # a chart that drops a key it does not know would hide it from the daemon
    "unknown_key": ("_helpers.tpl", '{{- $_ := set $cfg "run_dir" .Values.runDir -}}',
                    '{{- $_ := set $cfg "run_dir" .Values.runDir -}}'
                    '{{- $_ := unset $cfg "bogus_knob" -}}',
                    "accepted kvpool.toml with bogus_knob"),
}


@pytest.mark.parametrize("prop", sorted(BREAKS))
def test_each_property_check_fails_on_a_broken_chart(prop: str, tmp_path: Path) -> None:
    template, old, new, says = BREAKS[prop]
    chart = broken_chart(tmp_path, template, old, new)
    values = with_tenants({})
    objs = render(values, chart=chart)
    with pytest.raises((AssertionError, ConfigError), match=says):
        if prop == "socket_dir":
            check_socket_dir(objs, "/run/kvpool")
        elif prop == "socket_group":
            check_socket_group(objs)
        elif prop == "not_root":
            check_daemon_not_root(objs, root_allowed=False)
        elif prop == "one_per_node":
            check_one_daemon_per_node(objs)
        elif prop == "probes":
            check_probes_call_daemon(objs, "/run/kvpool")
        elif prop == "config_knob":
            check_every_knob(chart)
        else:
            check_unknown_key_refused(chart)


# ---- the configuration ------------------------------------------------------------------
def every_knob() -> dict[str, Any]:
    """A valid value, other than the default, for every key of the daemon's schema."""
    group = grp.getgrgid(os.getgid()).gr_name
    return {
        "backend": "host", "device": 3, "devices": "0,1", "device_budgets": {"1": "6GiB"},
        "budget": "75%", "page_size": "4MiB",
        "huge_pages": False, "run_dir": "/run/kvpool", "socket_mode": "0640",
        "socket_group": group, "admin_group": group, "warm_min": "4p",
        "warm_max": 1 << 40, "default_max": "90%",
        "tenants": {"llama-8b": {"min": "1GiB", "max": "60%", "shares": 2.5, "uids": [1001, 0],
                                 "group": group, "handoff_to": ["decode"],
                                 "sleepable": True},
                    "a.b": {"shares": 1}},
        "liveness_s": 0.125, "register_timeout_s": 7.5, "send_timeout_s": 3,
        "handoff_letgo_s": 0.5, "reclaim_timeout_s": 1.5, "reclaim_policy": "priority",
        "recover_timeout_s": 0,
        "log_level": "debug", "metrics_address": "0.0.0.0:9400", "metrics_allow_remote": True,
        "max_sessions_per_uid": 65, "max_sessions": 2048, "max_groups_per_tenant": 9,
        "max_virtual_pages_per_tenant": (1 << 20) + 1, "max_queued_fds": 123457,
        "idle_work_s": 0.001, "adopt_wait_s": 0.75, "short_backoff_s": 0.3,
        "status_interval_s": 6.5, "snapshot_timeout_s": 2.5, "refusal_log_interval_s": 1e-3,
        "burst": 65, "accept_burst": 9, "interleave": 7, "drain_slice": 4097,
        "control_hwm": 10001, "event_ring": 4095,
        "endpoints_file": "/srv/router/node.yaml", "endpoints_address": "10.0.0.5",
        "endpoints_namespace": "ns1",
    }


def check_every_knob(chart: Path | None = None) -> None:
    """Every key of the schema set through `config` reaches kvpool.toml, and the daemon's
    loader reads back the same configuration as from the values themselves."""
    knobs = every_knob()
    values = {"config": {k: v for k, v in knobs.items() if k != "metrics_address"},
              "metrics": {"enabled": True, "port": 9400}}
    objs = render(values, **({"chart": chart} if chart else {}))
    parsed = tomllib.loads(config_toml(objs))
    assert set(parsed) == set(knobs), set(parsed) ^ set(knobs)
    assert Config.from_dict(parsed) == Config.from_dict(knobs)


def check_unknown_key_refused(chart: Path | None = None) -> None:
    """A key the daemon does not know reaches kvpool.toml, and the daemon's loader refuses
    it naming it (`kvpool daemon` exits 2 with that line: test_chart_daemon)."""
    objs = render({"config": {"bogus_knob": 1}}, **({"chart": chart} if chart else {}))
    parsed = tomllib.loads(config_toml(objs))
    try:
        Config.from_dict(parsed)
    except ConfigError as e:
        assert e.problems == ["unknown configuration keys: bogus_knob"]
    else:
        raise AssertionError("the daemon's loader accepted kvpool.toml with bogus_knob")


def test_every_knob_covers_the_schema() -> None:
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(every_knob()) == names
    defaults = Config()
    for key, value in every_knob().items():  # each differs from the default
        assert getattr(Config.from_dict({key: value} if key != "tenants" else {}), key) \
            != getattr(defaults, key) or key in ("huge_pages", "run_dir", "tenants"), key


def test_configmap_reaches_every_knob() -> None:
    check_every_knob()


def test_unknown_key_reaches_the_daemon_and_is_refused() -> None:
    check_unknown_key_refused()


def test_run_dir_and_metrics_address_have_one_source() -> None:
    from helm_python import HelmError

    with pytest.raises(HelmError, match="set runDir alone"):
        render({"config": {"run_dir": "/elsewhere"}})
    with pytest.raises(HelmError, match="metrics.enabled"):
        render({"config": {"metrics_address": "127.0.0.1:1"}})
    parsed = tomllib.loads(config_toml(render({"metrics": {"enabled": False}})))
    assert "metrics_address" not in parsed
