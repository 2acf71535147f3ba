"""Each remedy ``doctor`` gives for containerd, applied as written to that containerd's config file: the
verdict turns to applied and the VMM's guest boots.

For containerd 1.7.24 (a version 2 file, and one without ``version``: version 1, whose CRI table is
``[plugins.cri]``) and 2.1.9 (its own version 3 file, and a version 2 file), each
started once with CDI off and once with a ``cdi_spec_dirs`` that leaves the daemon's directory out: the
runtime is asked as the daemon asks it (``cri.ask.ask``), ``remedies.cdi_remedy`` gives the remedy
for its config file (read as ``doctor`` reads /etc/containerd/config.toml), the remedy's settings are
written into the remedy's table of that file as an operator would, containerd is restarted on it, asked
again, and given a pod with the daemon's Allocate answer. The remedy of 1.x's layout written into a
version 3 file is shown to change nothing on 2.1 (it ignores the old table's CDI keys).

They need root, /dev/kvm and containerd; they skip without them, and fail instead where
``ATE_REQUIRE_CONTAINERD=1`` (``make check``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ate_devplugd.cri import ask as runtime_ask
from ate_devplugd.cri import remedies
from ate_devplugd.cri.facts import CdiVerdict
from tests.podman import NodeStat
from tests.runtimes.containerd import Containerd, Images, require, run_allocated
from tests.support import allocated_kvm


@pytest.fixture
def closed_kvm() -> NodeStat:
    """The host's /dev/kvm keeps strangers out (else a booted guest would prove nothing)."""
    node = NodeStat.of("/dev/kvm")
    assert node.mode & 0o007 == 0, f"the host's /dev/kvm is {node.mode:#o}: open to every user"
    return node


def apply_remedy(config: str, remedy: remedies.Remedy) -> str:
    """The remedy's settings written into its table of a TOML file, as an operator edits it: a key the
    table has is replaced, a missing one added under the table's header (the table is added at the end
    where the file has none); the ``version`` it names is put at the top first."""
    lines = [line for line in config.splitlines() if remedy.version is None or not line.startswith("version =")]
    if remedy.version is not None:
        lines.insert(0, f"version = {remedy.version}")
    if remedy.table not in lines:
        lines += ["", remedy.table]
    start = lines.index(remedy.table)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    for key, value in remedy.settings:
        at = next((i for i in range(start + 1, end) if lines[i].split("=")[0].strip() == key), None)
        if at is None:
            lines.insert(start + 1, f"  {key} = {value}")
            end += 1
        else:
            lines[at] = f"  {key} = {value}"
    return "\n".join(lines) + "\n"


def table_of(config: str, table: str) -> dict[str, object]:
    """A table of a TOML text by its header as written (``[plugins."io.containerd.grpc.v1.cri"]``)."""
    node: dict[str, object] = tomllib.loads(config)
    for key in tomllib.loads(f"{table}\n").get("plugins", {}):
        node = node["plugins"][key]  # type: ignore[index]
    return node


#: The CRI table of each config version containerd 1.x and 2.x read.
TABLES = {1: remedies.CONTAINERD_V1_TABLE, 2: remedies.CONTAINERD_V2_TABLE, 3: remedies.CONTAINERD_V3_TABLE}


async def restart(rt: Containerd, config_text: str) -> Containerd:
    """``systemctl restart containerd`` after the file was edited."""
    await rt.stop()
    return await Containerd.start(rt.build, rt.workdir, config_text=config_text)


#: (series, config version, what is wrong at first): every containerd remedy that is a config change.
CASES = [
    ("1.7", 1, "cdi off"),
    ("1.7", 1, "dir left out"),
    ("1.7", 2, "cdi off"),
    ("1.7", 2, "dir left out"),
    ("2.1", 3, "cdi off"),
    ("2.1", 3, "dir left out"),
    ("2.1", 2, "cdi off"),
    ("2.1", 2, "dir left out"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-v{v}-{w.replace(' ', '-')}" for s, v, w in CASES])
async def test_remedy_makes_it_apply(
    case: tuple[str, int, str], cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
) -> None:
    series, config_version, wrong = case
    build = require(series)
    cdi_dir = tmp_path / "cdi"  # the daemon's cdi_dir in allocated_kvm
    if wrong == "cdi off":
        options: dict[str, object] = {"enable_cdi": False, "cdi_spec_dirs": [cdi_dir]}
        before = CdiVerdict.NOT_APPLIED
    else:
        options = {"enable_cdi": True if series == "1.7" else None, "cdi_spec_dirs": [tmp_path / "elsewhere"]}
        before = CdiVerdict.DIR_NOT_READ
    images = [cri_images.pause, cri_images.checker]
    async with allocated_kvm(tmp_path) as allocation:
        rt = await Containerd.start(
            build, tmp_path / "containerd", images=images, config_version=config_version, **options
        )
        try:
            report = await runtime_ask.ask(str(rt.socket), str(cdi_dir))
            assert report.verdict is before, report
            remedy = remedies.cdi_remedy(report, str(cdi_dir), remedies.read_config_file(str(rt.config_path)))
            print(f"containerd {build.version}, version {config_version} file: {remedy.text}")
            assert (remedy.table, remedy.file, remedy.version) == (TABLES[config_version], str(rt.config_path), None)
            assert (
                f"{remedy.table} of {remedy.file}" in remedy.text or f"{remedy.table} cdi_spec_dirs of" in remedy.text
            )
            edited = apply_remedy(rt.config_path.read_text(), remedy)
            for key, value in remedy.settings:
                assert table_of(edited, remedy.table)[key] == tomllib.loads(f"v = {value}")["v"]
            rt = await restart(rt, edited)
            after = await runtime_ask.ask(str(rt.socket), str(cdi_dir))
            assert after.verdict is CdiVerdict.APPLIED, after
            run = await run_allocated(rt, allocation)
        finally:
            await rt.stop()
    print(run.summary())
    assert run.check is not None and run.check.guest is not None and run.check.guest.booted, run.summary()


async def test_old_table_in_a_version_3_file_changes_nothing(
    cri_images: Images, tmp_path: Path, closed_kvm: NodeStat
) -> None:
    """1.x's remedy (enable_cdi = true in [plugins."io.containerd.grpc.v1.cri"]) applied to 2.1's own
    version 3 file: containerd logs ``Ignoring unknown key`` and CDI stays off; 2.x's remedy then works."""
    build = require("2.1")
    cdi_dir = tmp_path / "cdi"
    old = remedies.Remedy("", remedies.CONTAINERD_V2_TABLE, (("enable_cdi", "true"),))
    rt = await Containerd.start(
        build, tmp_path / "containerd", config_version=3, enable_cdi=False, cdi_spec_dirs=[cdi_dir]
    )
    try:
        rt = await restart(rt, apply_remedy(rt.config_path.read_text(), old))
        report = await runtime_ask.ask(str(rt.socket), str(cdi_dir))
        ignored = [line for line in rt.log().splitlines() if "Ignoring unknown key" in line]
        print(*ignored, sep="\n")
        assert any("key=enable_cdi plugin=io.containerd.grpc.v1.cri" in line for line in ignored), rt.log_tail()
        assert report.verdict is CdiVerdict.NOT_APPLIED, report
        remedy = remedies.cdi_remedy(report, str(cdi_dir), remedies.read_config_file(str(rt.config_path)))
        assert remedy.table == remedies.CONTAINERD_V3_TABLE, remedy
        rt = await restart(rt, apply_remedy(rt.config_path.read_text(), remedy))
        assert (await runtime_ask.ask(str(rt.socket), str(cdi_dir))).verdict is CdiVerdict.APPLIED
    finally:
        await rt.stop()
