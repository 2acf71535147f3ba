"""The CDI verdict from a runtime's Version and verbose Status answers, rule by rule of its code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport, decide, parse_version, reads_dir
from tests.fakes.cri import containerd_info, recorded

OURS = "/var/run/cdi"


def crio_info(spec_dirs: list[str] | None) -> dict[str, str]:
    """CRI-O's verbose info: ``config`` = {"sandboxImage", "crio": RuntimeConfig} (1.33 on; before, no "crio")."""
    config: dict[str, object] = {"sandboxImage": "registry.k8s.io/pause:3.10"}
    if spec_dirs is not None:
        config["crio"] = {"CDISpecDirs": spec_dirs, "DefaultRuntime": "crun"}
    return {"config": json.dumps(config)}


CASES = [
    # containerd 1.6: no CDI in pkg/cri at v1.6.20, and no enableCDI in its config
    ("containerd", "1.6.20~ds1", containerd_info(None), CdiVerdict.NOT_APPLIED, "no CDI before containerd 1.7"),
    # 1.7.0/1.7.1: WithCDI(annotations) only
    ("containerd", "v1.7.1", containerd_info(True), CdiVerdict.NOT_APPLIED, "annotations only"),
    ("containerd", "1.7.24~ds1", containerd_info(False), CdiVerdict.NOT_APPLIED, "enable_cdi = false"),
    ("containerd", "1.7.24", containerd_info(True), CdiVerdict.APPLIED, "reads /var/run/cdi"),
    ("containerd", "v1.7.2", containerd_info(True, ["/run/cdi"]), CdiVerdict.APPLIED, "reads /var/run/cdi"),
    (
        "containerd",
        "1.7.24",
        containerd_info(True, ["/etc/cdi"]),
        CdiVerdict.DIR_NOT_READ,
        "cdi_spec_dirs = [/etc/cdi] leaves out /var/run/cdi",
    ),
    ("containerd", "1.7.24", containerd_info(True, []), CdiVerdict.DIR_NOT_READ, "cdi_spec_dirs = [none]"),
    ("containerd", "v2.0.0", containerd_info(True), CdiVerdict.APPLIED, "reads"),
    ("containerd", "v2.0.0", containerd_info(False), CdiVerdict.NOT_APPLIED, "enable_cdi = false"),
    # 2.3 on: a *bool, null when unset, and unset means on
    ("containerd", "v2.3.0", containerd_info(None, ["/etc/cdi", "/var/run/cdi"]), CdiVerdict.APPLIED, "reads"),
    ("containerd", "1.7.24", {}, CdiVerdict.UNKNOWN, "its Status gives no config"),
    ("containerd", "1.7.24", {"config": "{not json"}, CdiVerdict.UNKNOWN, "its Status gives no config"),
    ("containerd", "1.7.24", {"config": "{}"}, CdiVerdict.UNKNOWN, "no enableCDI"),
    ("containerd", "devel", containerd_info(True), CdiVerdict.UNKNOWN, "not a version"),
    ("cri-o", "1.27.1", crio_info(None), CdiVerdict.NOT_APPLIED, "annotations only"),
    ("cri-o", "1.34.0", crio_info(["/etc/cdi", "/var/run/cdi"]), CdiVerdict.APPLIED, "reads"),
    ("cri-o", "1.34.0", crio_info(["/etc/cdi"]), CdiVerdict.DIR_NOT_READ, "leaves out /var/run/cdi"),
    ("cri-o", "1.30.4", crio_info(None), CdiVerdict.APPLIED, "unless cdi_spec_dirs was changed"),
    ("podman-cri", "1.0", {}, CdiVerdict.UNKNOWN, "how podman-cri treats CDI names is not known"),
]


class TestDecide:
    @pytest.mark.parametrize(("name", "version", "info", "verdict", "why"), CASES)
    def test_rules(self, name: str, version: str, info: dict[str, str], verdict: CdiVerdict, why: str) -> None:
        """Each runtime's rule gives its verdict, and the reason says which rule."""
        report = decide(name, version, info, OURS, socket="/run/x.sock")
        assert report.verdict is verdict
        assert why in report.reason
        assert (report.name, report.version, report.socket) == (name, version, "/run/x.sock")

    def test_crio_elsewhere_before_133_is_unknown(self) -> None:
        """A CRI-O that does not report its directories cannot be said to read a non-default one."""
        report = decide("cri-o", "1.30.0", crio_info(None), "/srv/cdi")
        assert report.verdict is CdiVerdict.UNKNOWN

    def test_describe(self) -> None:
        """STATUS reads as an operator would say it."""
        off = decide("containerd", "1.7.24", containerd_info(False), OURS)
        assert off.describe() == "containerd 1.7.24 ignores CDI (enable_cdi = false)"
        gone = RuntimeReport(CdiVerdict.UNKNOWN, "no runtime socket at /run/containerd/containerd.sock")
        assert (
            gone.describe() == "unknown whether CDI is applied (no runtime socket at /run/containerd/containerd.sock)"
        )
        assert gone.runtime == ""
        # Debian's containerd 2.x answers "2.1.9+unknown" (built without a git revision): shown as 2.1.9.
        on = decide("containerd", "2.1.9+unknown", containerd_info(True), OURS)
        assert on.describe() == f"containerd 2.1.9 applies CDI (reads {OURS})"
        assert decide("containerd", "v1.7.24", containerd_info(False), OURS).runtime == "containerd 1.7.24"


class TestRecorded:
    @pytest.mark.parametrize(
        ("name", "verdict", "reason"),
        [
            ("containerd-1.6.20", CdiVerdict.NOT_APPLIED, "no CDI before containerd 1.7"),
            ("containerd-1.7.24-cdi-off", CdiVerdict.NOT_APPLIED, "enable_cdi = false"),
            ("containerd-1.7.24-cdi-on", CdiVerdict.APPLIED, "reads /var/run/cdi"),
        ],
    )
    def test_real_answers(self, name: str, verdict: CdiVerdict, reason: str) -> None:
        """Version and Status(verbose) as Debian's containerd 1.6.20 and 1.7.24 answered them."""
        runtime, version, info = recorded(name)
        report = decide(runtime, version, info, OURS)
        assert (report.verdict, report.reason) == (verdict, reason)

    def test_real_answer_elsewhere(self) -> None:
        """The same 1.7.24 answer, with the daemon writing elsewhere: the directory is not read."""
        report = decide(*recorded("containerd-1.7.24-cdi-on"), "/srv/cdi")
        assert report.verdict is CdiVerdict.DIR_NOT_READ
        assert report.spec_dirs == ("/etc/cdi", "/var/run/cdi")


class TestPaths:
    def test_versions(self) -> None:
        assert parse_version("v1.7.24") == (1, 7, 24)
        assert parse_version("1.6.20~ds1") == (1, 6, 20)
        assert parse_version("2.0.0+unknown") == (2, 0, 0)
        assert parse_version("1.36") == (1, 36, 0)
        assert parse_version("") is None

    def test_reads_dir_through_parent_links_not_its_own(self, tmp_path: Path) -> None:
        """The CDI library walks a spec directory from an Lstat: a symlinked parent is fine, a symlink itself is not."""
        real = tmp_path / "run"
        (real / "cdi").mkdir(parents=True)
        (tmp_path / "var").mkdir()
        os.symlink(real, tmp_path / "var" / "run")
        os.symlink(real / "cdi", tmp_path / "cdi-link")
        ours = str(tmp_path / "var" / "run" / "cdi")
        assert reads_dir(str(real / "cdi"), ours)
        assert reads_dir(ours, str(real / "cdi"))
        assert reads_dir(str(real / "cdi") + "/", ours)
        assert not reads_dir(str(tmp_path / "cdi-link"), ours)
        assert not reads_dir("relative/cdi", ours)
        assert not reads_dir(str(tmp_path / "other"), ours)
