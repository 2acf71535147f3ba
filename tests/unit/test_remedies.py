"""remedies: the table each runtime and config layout reads, the file to edit, and the config change.

That each remedy works is shown on the real runtimes in tests/integration/test_remedies_containerd.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ate_devplugd.cri.ask import read_commands
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport
from ate_devplugd.cri.remedies import (
    CONTAINERD_V1_TABLE,
    CONTAINERD_V2_TABLE,
    CONTAINERD_V3_TABLE,
    ConfigFile,
    Remedy,
    cdi_remedy,
    config_version,
    containerd_config,
    read_config_file,
)

CDI_DIR = "/var/run/cdi"
OFF = CdiVerdict.NOT_APPLIED
NOT_READ = CdiVerdict.DIR_NOT_READ


def report(name: str, version: str, verdict: CdiVerdict, spec_dirs: tuple[str, ...] | None = None) -> RuntimeReport:
    return RuntimeReport(
        verdict, "", socket="/run/containerd/containerd.sock", name=name, version=version, spec_dirs=spec_dirs
    )


@pytest.mark.parametrize(
    ("version", "config", "table"),
    [
        ("1.7.24~ds1", None, CONTAINERD_V2_TABLE),
        ("1.7.24~ds1", ConfigFile("/etc/containerd/config.toml", 2), CONTAINERD_V2_TABLE),
        ("2.1.9+unknown", ConfigFile("/etc/containerd/config.toml", 3), CONTAINERD_V3_TABLE),
        ("v2.0.0", ConfigFile("/etc/containerd/config.toml", 2), CONTAINERD_V2_TABLE),
        ("1.7.24~ds1", ConfigFile("/etc/containerd/config.toml", 1), CONTAINERD_V1_TABLE),
    ],
)
def test_enable_cdi_in_the_table_the_layout_reads(version: str, config: ConfigFile | None, table: str) -> None:
    remedy = cdi_remedy(report("containerd", version, OFF), CDI_DIR, config)
    assert remedy == Remedy(
        f"set enable_cdi = true in {table} of /etc/containerd/config.toml, restart containerd, then kubelet",
        table,
        (("enable_cdi", "true"),),
        "/etc/containerd/config.toml",
    )


def test_containerd_2_with_an_unread_file_names_both_layouts() -> None:
    remedy = cdi_remedy(report("containerd", "2.1.9", OFF), CDI_DIR, ConfigFile("/etc/containerd/config.toml"))
    assert remedy.table == CONTAINERD_V3_TABLE
    assert remedy.text == (
        f"set enable_cdi = true in {CONTAINERD_V3_TABLE} (a version 3 file; {CONTAINERD_V2_TABLE} in a version 2 "
        "file) of /etc/containerd/config.toml, restart containerd, then kubelet"
    )


def test_containerd_2_with_a_version_1_file_needs_a_version_first() -> None:
    """2.x reads no CRI key of a file without ``version``: the remedy gives it one, then 2.x's table."""
    config = ConfigFile("/etc/containerd/config.toml", 1)
    remedy = cdi_remedy(report("containerd", "2.1.9", NOT_READ, ("/etc/cdi", "/var/run/cdi")), "/srv/cdi", config)
    assert (remedy.table, remedy.version) == (CONTAINERD_V3_TABLE, 3)
    assert remedy.text == (
        "give /etc/containerd/config.toml version = 3 at its top (2.x reads no CRI key of a file without one), "
        f"then add /srv/cdi to {CONTAINERD_V3_TABLE} cdi_spec_dirs of /etc/containerd/config.toml and restart "
        "the runtime, or set cdi_dir to a directory it reads"
    )
    assert cdi_remedy(report("containerd", "1.7.24", OFF), CDI_DIR, config).version is None


def test_the_file_read_is_the_file_named() -> None:
    config = ConfigFile("/var/lib/rancher/k3s/agent/etc/containerd/config.toml", 3)
    remedy = cdi_remedy(report("containerd", "2.1.9", OFF), CDI_DIR, config)
    assert remedy.file == config.path
    assert f"{CONTAINERD_V3_TABLE} of {config.path}," in remedy.text


@pytest.mark.parametrize(("declared", "table"), [(3, CONTAINERD_V3_TABLE), (2, CONTAINERD_V2_TABLE)])
def test_spec_dirs_keep_the_runtime_s_and_add_ours(declared: int, table: str) -> None:
    dirs = ("/etc/cdi", "/opt/cdi")
    config = ConfigFile("/etc/containerd/config.toml", declared)
    remedy = cdi_remedy(report("containerd", "2.1.9", NOT_READ, dirs), CDI_DIR, config)
    assert remedy.table == table
    assert remedy.settings == (("cdi_spec_dirs", '["/etc/cdi", "/opt/cdi", "/var/run/cdi"]'),)
    assert remedy.text == (
        f"add /var/run/cdi to {table} cdi_spec_dirs of /etc/containerd/config.toml and restart the runtime, "
        "or set cdi_dir to a directory it reads"
    )


def test_before_1_7_2_an_upgrade() -> None:
    for version in ("1.6.20~ds1", "1.7.1"):
        remedy = cdi_remedy(report("containerd", version, OFF), CDI_DIR)
        assert remedy == Remedy("upgrade containerd to 1.7.2 or later (with enable_cdi = true) or 2.x")
        # a cdi_dir the new version does not read by default: the upgrade alone would not do
        assert cdi_remedy(report("containerd", version, OFF), "/srv/cdi").text == (
            "upgrade containerd to 1.7.2 or later (with enable_cdi = true) or 2.x, and add /srv/cdi to its "
            "cdi_spec_dirs (by default it reads only /etc/cdi and /var/run/cdi)"
        )


def test_the_config_file_the_running_containerd_was_given(tmp_path: Path) -> None:
    """k3s and RKE2 start containerd with -c/--config: the remedy names that file, read from /proc (the
    one serving the asked socket first; a relative path from its working directory); none: the default."""
    proc = tmp_path / "proc"
    k3s = "/run/k3s/containerd/containerd.sock"
    for pid, argv, cwd in (
        (40, ["containerd"], "/"),
        (41, ["containerd", "-c", "etc/containerd/config.toml", "-a", k3s], "/var/lib/rancher/k3s/agent"),
        (42, ["dockerd"], "/"),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(argv[0] + "\n")
        (proc / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (proc / str(pid) / "cwd").symlink_to(cwd)
    commands = read_commands("containerd", str(proc))
    assert [argv[0] for argv, _ in commands] == ["containerd", "containerd"]
    assert containerd_config(commands, k3s) == "/var/lib/rancher/k3s/agent/etc/containerd/config.toml"
    assert containerd_config(commands, "/run/containerd/containerd.sock") == "/etc/containerd/config.toml"
    rke2 = (("containerd", "--config=/etc/rke2.toml", "--address=/run/k3s/containerd/containerd.sock"), "/")
    assert containerd_config([rke2], k3s) == "/etc/rke2.toml"
    assert containerd_config([rke2], "/srv/other.sock") == "/etc/containerd/config.toml"  # another one's
    assert containerd_config([], k3s) == "/etc/containerd/config.toml"
    config = tmp_path / "k3s.toml"
    config.write_text("version = 3\n")
    given = read_config_file(containerd_config([(("containerd", "--config", str(config), "-a", k3s), "/")], k3s))
    remedy = cdi_remedy(report("containerd", "2.1.9", OFF), CDI_DIR, given)
    assert f"of {config}, restart containerd" in remedy.text and remedy.file == str(config)


def test_crio_as_before() -> None:
    assert cdi_remedy(report("cri-o", "1.27.1", OFF), CDI_DIR).text == (
        "upgrade cri-o (CRI-O 1.28 or later applies CDI names)"
    )
    remedy = cdi_remedy(report("cri-o", "1.33.0", NOT_READ, ("/etc/cdi",)), CDI_DIR)
    assert remedy.text == (
        "add /var/run/cdi to [crio.runtime] cdi_spec_dirs and restart the runtime, "
        "or set cdi_dir to a directory it reads"
    )
    assert remedy.settings == (("cdi_spec_dirs", '["/etc/cdi", "/var/run/cdi"]'),)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("version = 3\n[plugins]\n", 3),
        ("version = 2\n", 2),
        ("# no version: containerd's version 1\n[plugins.cri]\n", 1),
        ("", 1),
        ('version = "3"\n', None),
        ("version = true\n", None),
        ("version = \n", None),
    ],
)
def test_config_version(text: str, version: int | None) -> None:
    assert config_version(text) == version


def test_read_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    assert read_config_file(str(path)) == ConfigFile(str(path), None)
    path.write_text("version = 3\n")
    assert read_config_file(str(path)) == ConfigFile(str(path), 3)
    path.write_bytes(b"\xff\xfe")
    assert read_config_file(str(path)) == ConfigFile(str(path), None)
