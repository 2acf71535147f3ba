"""Hostile configuration: wrong types, huge counts, odd unicode, paths with .., non-/dev paths (property-based).

- Any document either loads into a config that kubelet would accept, or fails with ConfigError whose
  every line names the field; nothing else escapes (no traceback).
- ``run`` and ``check-config`` on a bad file exit 78 with that error, and ``run`` creates nothing.
- A ``path`` that exists but is not the kernel's character device (a directory, a regular file, a
  symlink to something else, a symlink loop) is documented behaviour: absent, not served.
- On SIGHUP with a bad file the running config stays: same socket, no new registration, a logged error.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ate_devplugd import config as configmod
from ate_devplugd._pb import api_pb2
from ate_devplugd.config import ConfigError
from ate_devplugd.config import device as device_config
from tests.fakes.kubelet import extended_resource_name_ok
from tests.fault.harness import (
    SOCKET,
    ProcFigures,
    assert_no_leak,
    daemon_log_clean,
    scale,
    settled,
    sockets_in,
)
from tests.support import NotifyReceiver, daemon, started_kubelet, subprocess_env, write_config

EX_CONFIG = 78
SETTINGS = settings(
    max_examples=scale(300, 5000),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
CLI_SETTINGS = settings(
    max_examples=scale(12, 150),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TOP_KEYS = ("plugin_dir", "dev_root", "log_level", "device")
DEVICE_KEYS = ("resource", "path", "count", "permissions", "preopen", "probe", "subsystem")


# -- a small TOML writer (tomllib only reads) ----------------------------------------------------
def toml_value(value: Any) -> str:  # noqa: PLR0911 - one return per TOML type
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in ('"', "\\"):
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_key(key: str) -> str:
    return key if key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key) else toml_value(key)


def toml_document(doc: dict[str, Any]) -> str:
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items() if k != "device" or not _is_tables(v)]
    if "device" in doc and _is_tables(doc["device"]):
        for table in doc["device"]:
            lines += ["", "[[device]]"] + [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) for t in value)


# -- strategies ---------------------------------------------------------------------------------
odd_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 1, 65536, 65537, 2**31, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
)
any_value = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(odd_text, inner, max_size=3)),
    max_leaves=6,
)
hostile_paths = st.one_of(
    st.sampled_from(
        [
            "/dev/../etc/shadow",
            "/dev/./kvm",
            "/dev//kvm",
            "/dev/kvm/",
            "/dev/kvm/..",
            "dev/kvm",
            "/dev/",
            "/dev",
            "/proc/self/mem",
            "/etc/passwd",
            "/dev/kvm\u0000",
            "/dev/\u202ekvm",
            "/dev/k\u00e9vm",
            "/dev/" + "k" * 300,
            "/dev/" + "a/" * 40 + "kvm",
            "",
            "..",
            "/",
        ]
    ),
    odd_text.map(lambda s: "/dev/" + s),
    odd_text,
)
hostile_resources = st.one_of(
    st.sampled_from(
        [
            "kvm",
            "ate.dev/",
            "/kvm",
            "ate.dev/kvm/x",
            "kubernetes.io/kvm",
            "requests.ate.dev/kvm",
            "ATE.dev/kvm",
            "ate.dev/-kvm",
            "ate.dev/kvm-",
            "a" * 254 + "/kvm",
            "ate.dev/" + "k" * 64,
            "ate.dev/k\u00e9vm",
            "ate..dev/kvm",
        ]
    ),
    odd_text,
    odd_text.map(lambda s: "ate.dev/" + s),
)
good_device = st.fixed_dictionaries(
    {"resource": st.just("ate.dev/kvm"), "path": st.just("/dev/kvm")},
    optional={
        "count": st.integers(1, 65536),
        "permissions": st.sampled_from(["r", "w", "rw", "wr", "rwm", "m"]),
        "preopen": st.booleans(),
        "probe": st.just("kvm"),
        "subsystem": st.just("misc"),
    },
)


@st.composite
def hostile_device(draw: st.DrawFn) -> dict[str, Any]:
    """A [[device]] table with one or more fields made hostile (or a key that does not exist)."""
    table = dict(draw(good_device))
    for key in draw(st.lists(st.sampled_from([*DEVICE_KEYS, "colour", "Path", ""]), min_size=1, max_size=3)):
        if key == "path":
            table[key] = draw(st.one_of(hostile_paths, any_value))
        elif key == "resource":
            table[key] = draw(st.one_of(hostile_resources, any_value))
        elif key == "count":
            table[key] = draw(st.one_of(st.integers(-(2**63), 2**63 - 1), any_value))
        else:
            table[key] = draw(any_value)
    if draw(st.booleans()):
        table.pop(draw(st.sampled_from(["resource", "path"])), None)
    return table


@st.composite
def hostile_document(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from([*TOP_KEYS, "devices", "Device", "x"]), max_size=4, unique=True)):
        if key == "device":
            doc[key] = draw(
                st.one_of(
                    st.lists(st.one_of(hostile_device(), good_device), min_size=1, max_size=4),
                    any_value,
                    st.just([]),
                )
            )
        elif key in ("plugin_dir", "dev_root"):
            doc[key] = draw(st.one_of(hostile_paths, any_value))
        else:
            doc[key] = draw(any_value)
    return doc


def assert_names_a_field(line: str, source: str) -> None:
    """Every error line says which field (or the file) it is about."""
    heads = (*TOP_KEYS, "device[", "unknown key", source)
    assert line.startswith(heads), line
    # one line, printable: a hostile value must not forge more lines in the journal or the terminal
    assert line.isprintable(), repr(line)
    if line.startswith("device["):
        rest = line.split(": ", 1)[1] if ": " in line else ""
        assert rest.startswith((*DEVICE_KEYS, "unknown key", "must be a table", "socket name")), line


def assert_kubelet_would_accept(cfg: configmod.Config) -> None:
    """What a loaded config sends to kubelet passes kubelet's own checks, and fits in one message."""
    assert cfg.plugin_dir.startswith("/") and cfg.dev_root.startswith("/")
    for dev in cfg.devices:
        assert extended_resource_name_ok(dev.resource), dev.resource
        assert dev.path.startswith("/dev/") and os.path.normpath(dev.path) == dev.path and "\0" not in dev.path
        assert ".." not in dev.path.split("/")
        assert 1 <= dev.count <= device_config.MAX_COUNT
        assert dev.permissions and set(dev.permissions) <= set("rwm")
        last_id = f"{dev.id_prefix}{dev.count - 1}"
        assert len(last_id) <= 63
        message = api_pb2.ListAndWatchResponse(
            devices=[api_pb2.Device(ID=f"{dev.id_prefix}{i}", health="Unhealthy") for i in range(dev.count)]
        )
        assert message.ByteSize() <= device_config.MAX_MESSAGE_BYTES


# -- in-process: every document, thousands of them ---------------------------------------------------
@SETTINGS
@given(st.one_of(hostile_document(), st.builds(lambda d: {"device": [d]}, good_device)))
def test_any_document_loads_or_names_the_field(doc: dict[str, Any]) -> None:
    """A document loads into a config kubelet accepts (which renders and reads back the same), or every
    error line names its field."""
    text = toml_document(doc)
    try:
        cfg = configmod.parse(text, source="hostile.toml")
    except ConfigError as exc:
        assert exc.errors
        for line in exc.errors:
            assert_names_a_field(line, "hostile.toml")
        return
    assert_kubelet_would_accept(cfg)
    assert configmod.parse(configmod.render(cfg)) == cfg


@SETTINGS
@given(st.text(max_size=200))
def test_any_text_loads_or_fails_cleanly(text: str) -> None:
    """Arbitrary text: ConfigError naming the file or a field, never another exception."""
    try:
        cfg = configmod.parse(text, source="junk.toml")
    except ConfigError as exc:
        for line in exc.errors:
            assert_names_a_field(line, "junk.toml")
        return
    assert_kubelet_would_accept(cfg)


# -- the command line: exit 78, the error, nothing created ------------------------------------------
def run_cli(command: str, cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ate_devplugd", command, "--config", str(cfg), "--log-target", "console"]
        if command == "run"
        else [sys.executable, "-m", "ate_devplugd", command, "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=30,
        check=False,
    )


def test_bad_file_exit_78_nothing_served(tmp_path: Path) -> None:
    """``run`` and ``check-config`` on hostile files: 78, the first error on stderr, no directory made."""
    counter = iter(range(10**6))

    @CLI_SETTINGS
    @given(hostile_document())
    def check(doc: dict[str, Any]) -> None:
        n = next(counter)
        plugin_dir = tmp_path / f"plugins-{n}"
        doc = {**doc, "plugin_dir": str(plugin_dir)} if "plugin_dir" not in doc else doc
        text = toml_document(doc)
        try:
            configmod.parse(text)
        except ConfigError as exc:
            first = exc.errors[0]
        else:
            assume(False)
        cfg = tmp_path / f"bad-{n}.toml"
        cfg.write_text(text, encoding="utf-8")
        for command in ("check-config", "run"):
            out = run_cli(command, cfg)
            assert out.returncode == EX_CONFIG, (command, text, out.stderr)
            assert "Traceback" not in out.stderr
            assert first in out.stderr, (first, out.stderr)
            assert out.stdout == ""
        assert not plugin_dir.exists()

    check()


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe not utf-8", b"[[device]]\npath = '/dev/kvm'\nresource = 'ate.dev/kvm'\nresource = 'x'\n", None],
    ids=["not-utf8", "duplicate-key", "directory"],
)
def test_unreadable_file_exit_78(tmp_path: Path, content: bytes | None) -> None:
    """A file that is not UTF-8, not TOML, or a directory: 78 with the file named."""
    cfg = tmp_path / "c.toml"
    if content is None:
        cfg.mkdir()
    else:
        cfg.write_bytes(content)
    for command in ("check-config", "run"):
        out = run_cli(command, cfg)
        assert out.returncode == EX_CONFIG, out
        assert str(cfg) in out.stderr and "Traceback" not in out.stderr, out.stderr


# -- a path that exists but is not the device: absent, not served -------------------------------------
def _not_the_device(root: Path, kind: str) -> None:
    node = root / "dev" / "kvm"
    node.unlink()
    if kind == "directory":
        node.mkdir()
    elif kind == "regular-file":
        node.write_text("not a device")
    elif kind == "symlink-to-file":
        node.symlink_to("/etc/hostname")
    elif kind == "symlink-loop":
        node.symlink_to("kvm")
    elif kind == "dangling-symlink":
        node.symlink_to("/nonexistent/kvm")
    elif kind == "other-char-device":
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null's numbers
    elif kind == "block-device":
        os.mknod(node, 0o600 | 0o060000, os.makedev(7, 0))
    elif kind == "fifo":
        os.mkfifo(node)


@pytest.mark.parametrize(
    "kind",
    [
        "regular-file",
        "symlink-to-file",
        "symlink-loop",
        "dangling-symlink",
        "other-char-device",
        "block-device",
        "fifo",
    ],
)
async def test_path_not_the_device_is_absent(tmp_path: Path, plugin_dir: Path, dev_root: Path, kind: str) -> None:
    """The configured path exists but is not the kernel's character device: not served (no socket, no
    registration), STATUS says absent with the reason; the daemon stays up and exits 0 on SIGTERM."""
    _not_the_device(dev_root, kind)
    kubelet = await started_kubelet(plugin_dir)
    notify = NotifyReceiver(tmp_path / "notify")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    try:
        async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
            ready = await notify.wait_for(lambda f: "READY" in f)
            assert ready["STATUS"].startswith("ate.dev/kvm: absent ("), (ready, proc.log())
            assert sockets_in(plugin_dir) == {"kubelet.sock"}
            assert not [e for e in kubelet.history if e.kind.startswith("register")]
            assert await proc.stop() == 0
            daemon_log_clean(proc.log())
    finally:
        await notify.close()
        await kubelet.stop()


def test_a_directory_path_is_refused_at_start(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """A path that is a directory can never be the device: start refuses it as check-config and a reload
    do (one validation), exit 78 with the line naming it, instead of serving it as an absent device."""
    _not_the_device(dev_root, "directory")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    done = run_cli("run", cfg)
    status, out, err = done.returncode, done.stdout, done.stderr
    assert status == os.EX_CONFIG and out == "", err
    assert err == (
        "ate-devplugd: config error: device[0] (ate.dev/kvm): path: '/dev/kvm' is a directory; "
        "path names a device node, e.g. '/dev/kvm'\n"
    ), err


# -- SIGHUP with a bad file: the old config stays --------------------------------------------------------
BAD_RELOADS = [
    ('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/../etc/shadow"\n', "path"),
    ('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = 9223372036854775807\n', "count"),
    ('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\ncount = "4096"\n', "count"),
    ('[[device]]\nresource = "ate.dev/kv\u00e9m"\npath = "/dev/kvm"\n', "resource"),
    ('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\npermissions = "rwx"\n', "permissions"),
    ("device = 7\n", "device"),
    ("[[device]\n", "not valid TOML"),
    ("log_level = 3\n", "log_level"),
]


async def test_sighup_with_bad_config_keeps_the_old(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """Each bad file then SIGHUP: RELOADING=1, READY=1 again, the error logged with its field and the
    first one at the end of STATUS, the same socket still registered (no new Register), Allocate still
    answered; nothing leaked."""
    kubelet = await started_kubelet(plugin_dir)
    notify = NotifyReceiver(tmp_path / "notify")
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    good = cfg.read_text()
    try:
        async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
            await notify.wait_for(lambda f: "READY" in f)
            await settled(kubelet)
            identity = os.lstat(plugin_dir / SOCKET).st_ino
            registrations = len([e for e in kubelet.history if e.kind == "register"])
            before = ProcFigures.of(proc.pid)
            for text, field in BAD_RELOADS * scale(1, 20):
                cfg.write_text(f'plugin_dir = "{plugin_dir}"\ndev_root = "{dev_root}"\n' + text)
                log_before = len(proc.log())
                await proc.signal(signal.SIGHUP)
                await notify.wait_for(lambda f: "RELOADING" in f)
                ready = await notify.wait_for(lambda f: "READY" in f)
                kept, refused = ready["STATUS"].split(" | reload refused ")
                assert kept == "ate.dev/kvm: 4096/4096 healthy, registered", ready
                assert re.fullmatch(r"\d\d:\d\d:\d\d: .+", refused) and field in refused, ready
                new_log = proc.log()[log_before:]
                assert "reload-failed" in new_log and field in new_log, new_log
                assert os.lstat(plugin_dir / SOCKET).st_ino == identity
                await kubelet.allocate("ate.dev/kvm", ["kvm-1"])
            assert len([e for e in kubelet.history if e.kind == "register"]) == registrations
            cfg.write_text(good)
            assert_no_leak("bad-reloads", proc.pid, before, ProcFigures.of(proc.pid), len(BAD_RELOADS))
            assert await proc.stop() == 0
            daemon_log_clean(proc.log())
        assert sockets_in(plugin_dir) == {"kubelet.sock"}
    finally:
        await notify.close()
        await kubelet.stop()
