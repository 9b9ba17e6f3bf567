"""The shipped systemd units and example configuration.

`systemd-analyze verify` checks a unit's keys and values without a running systemd. A misspelled
key only warns and still exits 0, so any output at all counts as failure. It also insists that the
ExecStart binary exists, so the test verifies copies whose ExecStart names this venv's `poold`
instead of /opt/gpupool/bin/poold; nothing else is changed. (`User=gpupool` of a user this machine
lacks draws no warning from systemd 252, as root or not, so the copies keep it.)
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import config
from tests.support.paths import ROOT

SYSTEMD = ROOT / "systemd"
UNITS = ("pool-server.service", "pool-worker.service")
SHIPPED_POOLD = "/opt/gpupool/bin/poold"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(SYSTEMD / name)
    return parser


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (Debian: apt install systemd)"
)
def test_units_verify_cleanly(tmp_path: Path) -> None:
    poold = Path(sys.executable).parent / "poold"
    assert poold.is_file(), "poold is not installed in this venv (pip install -e .)"
    copies = []
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        assert f"ExecStart={SHIPPED_POOLD} " in text
        (tmp_path / name).write_text(text.replace(SHIPPED_POOLD, str(poold)))
        copies.append(str(tmp_path / name))
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *copies], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.parametrize("name", UNITS)
def test_unit_settings(name: str) -> None:
    service = unit(name)["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["WatchdogSec"] == "30"
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "mixed"  # poold stops its jobs itself; systemd signals only it
    if name == "pool-worker.service":  # root, bounded, so that each slot's jobs get a uid of their own
        assert "User" not in service
        assert service["Environment"].startswith("GPUPOOL_JOB_UID_RANGE=")
        config.uid_range_of(service["Environment"].split("=", 1)[1])
        caps = (
            "CAP_SETUID CAP_SETGID CAP_SETPCAP CAP_CHOWN CAP_KILL CAP_DAC_OVERRIDE CAP_FOWNER CAP_SYS_ADMIN"
        )
        assert set(service["RestrictNamespaces"].split()) == {
            "mnt",
            "ipc",
            "net",
        }  # each job's own (confine.py)
        assert set(service["CapabilityBoundingSet"].split()) == set(caps.split())
    else:
        assert (service["User"], service["Group"]) == ("gpupool", "gpupool")
    assert service["StateDirectory"] == "gpupool"
    assert service["ProtectSystem"] == "strict"
    assert service["NoNewPrivileges"] == "yes"
    # Jobs must see /dev/nvidia*: nothing that turns on a private /dev or the device filter.
    for setting in ("PrivateDevices", "ProtectClock", "DevicePolicy", "DeviceAllow"):
        assert setting not in service, setting
    worker = "--worker" in service["ExecStart"]
    assert worker == (name == "pool-worker.service")
    assert (
        service["ExecStart"]
        == f"{SHIPPED_POOLD} {'--worker ' if worker else ''}--config /etc/gpupool/pool.toml"
    )
    # issue 47 item 2: `systemctl reload` sends SIGHUP, which poold reloads on (daemon/reload.py).
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # Stopping must outlast a drain: drain_timeout up to 300 s, plus kill_grace, plus hand-back.
    assert int(service["TimeoutStopSec"]) > 300 + config.BY_NAME["kill_grace"].default


def test_example_config_lists_every_option_with_its_default(tmp_path: Path) -> None:
    text = (SYSTEMD / "pool.toml.example").read_text()
    assignment = re.compile(r"^# ?([a-z_]+) = ")
    listed = [m.group(1) for line in text.splitlines() if (m := assignment.match(line))]
    options = [name for name in listed if name in config.BY_NAME]
    assert sorted(options) == sorted(config.BY_NAME), "pool.toml.example and daemon/config.py differ"
    assert len(options) == len(set(options))
    assert all(name.removesuffix("_file") in config.SECRET_NAMES for name in set(listed) - set(options))
    # Uncommented, the example loads, and every value is the default.
    uncommented = "\n".join(
        line[2:] if (m := assignment.match(line)) and m.group(1) in config.BY_NAME else line
        for line in text.splitlines()
    )
    path = tmp_path / "pool.toml"
    path.write_text(uncommented)
    loaded = config.load(env={}, config_file=path)
    for option in config.OPTIONS:
        assert getattr(loaded, option.name) == option.default, option.name
        assert loaded.sources[option.name].startswith(str(path)), option.name
