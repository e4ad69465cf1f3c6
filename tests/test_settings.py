"""Settings in the environment: a typo is warned about once per process, naming the setting
it is closest to; an on/off setting takes the documented spellings or raises ValueError;
a setting of seconds takes any positive, finite number (clamped to ``MAX_WAIT``)."""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

import gatherstore as gs
from gatherstore import _config
from gatherstore._config import MAX_WAIT, to_seconds

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No GATHERSTORE_* variable of the caller's shell, and nothing warned about yet."""
    for name in [n for n in os.environ if n.startswith("GATHERSTORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(_config, "_warned", set())
    return monkeypatch


def test_the_known_settings_are_the_table_of_the_settings_page() -> None:
    rows = re.findall(r"^\| ``(GATHERSTORE_\w+)`` \|", _config.__doc__ or "", re.MULTILINE)
    assert sorted(rows) == sorted(_config.SETTINGS)


@pytest.mark.parametrize(
    ("name", "nearest"),
    [("GATHERSTORE_STOR", "GATHERSTORE_STORE"), ("GATHERSTORE_TIMOUT", "GATHERSTORE_TIMEOUT")],
)
def test_a_mistyped_setting_warns_once_naming_the_nearest(
    clean_env: pytest.MonkeyPatch, name: str, nearest: str
) -> None:
    clean_env.setenv(name, "1")
    with pytest.warns(UserWarning) as caught:
        assert gs.all_gather_object(1) == [1]
    assert [str(w.message) for w in caught] == [
        f"{name} is set but is not a gatherstore setting, so it changes nothing: did you "
        f"mean {nearest}? (variables for tests start with GATHERSTORE_TEST_)"
    ]
    assert caught[0].filename == __file__  # the program's own call, not gatherstore's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second call is silent
        gs.barrier()
        with gs.ResultSet("quiet", store="memory://settings"):
            pass


def test_a_name_near_no_setting_lists_them(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("GATHERSTORE_ZZZ", "1")
    listed = pytest.warns(UserWarning, match="the settings are GATHERSTORE_STORE, ")
    with listed as caught, gs.ResultSet("listed", store="memory://settings"):
        pass
    assert caught[0].filename == __file__


def test_settings_tests_and_compose_variables_do_not_warn(clean_env: pytest.MonkeyPatch) -> None:
    for name in (*_config.SETTINGS, "GATHERSTORE_TEST_MY_SUITE", "GATHERSTORE_S3_KEY"):
        clean_env.setenv(name, os.environ.get(name, ""))  # set, empty: the defaults
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gs.all_gather_object(1) == [1]


def test_import_checks_nothing() -> None:
    """The check runs at the first call, never at ``import gatherstore`` (kept light)."""
    env = {**os.environ, "PYTHONPATH": SRC, "GATHERSTORE_STOR": "x", "GATHERSTORE_PROGRESS": "?"}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import gatherstore"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.parametrize(
    ("spelling", "meaning"),
    [
        *[("1", True), ("true", True), ("YES", True), ("On", True), (" yes ", True)],
        *[("0", False), ("False", False), ("no", False), ("OFF", False), ("", None)],
    ],
)
def test_on_off_spellings(
    clean_env: pytest.MonkeyPatch, spelling: str, meaning: bool | None
) -> None:
    clean_env.setenv("GATHERSTORE_PROGRESS", spelling)
    clean_env.setenv("GATHERSTORE_HANDOVER", spelling)
    assert _config.progress() is meaning
    assert _config.handover() is (meaning is not False)


@pytest.mark.parametrize("name", ["GATHERSTORE_PROGRESS", "GATHERSTORE_HANDOVER"])
def test_another_spelling_is_an_error_at_the_next_call(
    clean_env: pytest.MonkeyPatch, name: str
) -> None:
    clean_env.setenv(name, "sure")
    with pytest.raises(ValueError) as info:
        gs.all_gather_object(1)
    assert str(info.value) == (
        f"{name}='sure' is neither on nor off: set it to 1, true, yes or on (on), or to "
        "0, false, no or off (off), in any case, or unset it for the default"
    )
    with pytest.raises(ValueError, match=name):
        gs.ResultSet("refused", store="memory://settings")


def test_seconds_settings_are_clamped(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("GATHERSTORE_HEARTBEAT", "1e12")
    clean_env.setenv("GATHERSTORE_FLUSH_SECONDS", "1e12")
    assert _config.heartbeat_interval() == _config.MAX_WAIT
    assert _config.flush_every()[2] == _config.MAX_WAIT
    clean_env.setenv("GATHERSTORE_HEARTBEAT", "inf")
    with pytest.raises(ValueError, match="GATHERSTORE_HEARTBEAT='inf' is not a positive, finite"):
        _config.heartbeat_interval()


def test_the_timeout_setting_is_read_at_each_call(clean_env: pytest.MonkeyPatch) -> None:
    """Set after the import, it counts (``launch`` gives its ranks its ``timeout`` so);
    past the platform, it is clamped; malformed, the next call names it."""
    assert _config.to_seconds(None) == 1800.0
    clean_env.setenv("GATHERSTORE_TIMEOUT", "7.5")
    assert _config.to_seconds(None) == _config.default_timeout() == 7.5
    clean_env.setenv("GATHERSTORE_TIMEOUT", "1e12")
    assert _config.default_timeout() == _config.MAX_WAIT
    clean_env.setenv("GATHERSTORE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="GATHERSTORE_TIMEOUT='soon' is not a positive, finite"):
        gs.all_gather_object(1)


# --- timeouts longer than the platform waits: "as long as it takes" -------------------------
FOREVER = 1e12  # seconds: 31,700 years


def test_a_timeout_past_what_the_platform_waits_is_clamped() -> None:
    assert to_seconds(FOREVER) == MAX_WAIT == 24 * 86400
    assert to_seconds(dt.timedelta(days=10**6)) == MAX_WAIT
    assert to_seconds(10**400) == MAX_WAIT  # an int too large for a float is still finite
    assert to_seconds(600) == 600.0 and to_seconds(dt.timedelta(minutes=1)) == 60.0
    for refused in (math.inf, math.nan, 0, -FOREVER):
        with pytest.raises(ValueError, match="timeout="):
            to_seconds(refused)


def test_every_wait_below_takes_the_ceiling() -> None:
    """Python's waits, a socket's timeout, and a c10d store client's connect and wait (whose
    poll takes an int of milliseconds) all take MAX_WAIT, with the call's grace on top."""
    import torch.distributed as dist

    assert (MAX_WAIT + 3600) * 1000 < 2**31 - 1 and MAX_WAIT < threading.TIMEOUT_MAX
    done = threading.Event()
    done.set()
    assert done.wait(MAX_WAIT)
    with socket.socket() as sock:
        sock.settimeout(MAX_WAIT)
    span = dt.timedelta(seconds=MAX_WAIT)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=span, wait_for_workers=False)  # type: ignore[attr-defined]
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=span)  # type: ignore[attr-defined]
    threading.Timer(0.2, server.set, args=("key", "1")).start()
    client.wait(["key"], span)
    assert client.get("key") == b"1"
