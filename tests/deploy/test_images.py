"""The container definitions agree with the chart: the daemon image's user and group are
the chart's daemon.uid/gid, the daemon image installs the torch-free core alone, and the
chart's default image tag is the package version."""

from __future__ import annotations

import re

from .chart import CHART, REPO, values_of

DAEMON = REPO / "deploy" / "Containerfile.daemon"
ENGINE = REPO / "deploy" / "Containerfile.engine"


def test_daemon_image_user_is_the_charts_daemon_user() -> None:
    text = DAEMON.read_text()
    daemon = values_of(CHART / "values.yaml")["daemon"]
    uid, gid = daemon["uid"], daemon["gid"]
    assert re.search(rf"groupadd [^\n]*--gid {gid} kvpool", text)
    assert re.search(rf"useradd [^\n]*--uid {uid} --gid {gid}", text)
    assert re.search(rf"^USER {uid}:{gid}$", text, re.M)


def test_daemon_image_is_torch_free() -> None:
    installs = [line for line in DAEMON.read_text().splitlines()
                if "pip install" in line or "pip wheel" in line]
    assert installs and not any("torch" in line or "[" in line for line in installs)


def test_image_tags_follow_the_package_version() -> None:
    chart = values_of(CHART / "Chart.yaml")
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and chart["appVersion"] == version.group(1)
    assert values_of(CHART / "values.yaml")["image"]["tag"] == ""  # default: appVersion
    assert "--target engine" in ENGINE.read_text() and "--target vllm" in ENGINE.read_text()
