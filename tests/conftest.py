"""Test plumbing shared by every suite.

- ``async def`` tests run in a fresh event loop each, under a hard timeout (no plugin needed, so the
  suite runs the same on Debian's pytest 7 and on current PyPI releases); ``@pytest.mark.budget(s)``
  gives a long test its own;
- test order is shuffled; the seed is printed and ``ATE_TEST_SEED=N`` replays an order;
- the summary counts, per containerd series, the tests that drove it and how they ended, and shows
  what the tests marked ``figures`` printed (their measurements) when they passed.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.podman import NodeStat, Podman
from tests.podman import require as require_podman
from tests.runtimes.containerd import ContainerdBuild, Images, require_images
from tests.runtimes.containerd import require as require_containerd
from tests.support import FakeKernel, kvm_dev_root

TEST_TIMEOUT = float(os.environ.get("ATE_TEST_TIMEOUT", "60"))
_SEED = int(os.environ.get("ATE_TEST_SEED") or random.SystemRandom().randrange(1 << 30))


def pytest_report_header(config: pytest.Config) -> str:
    return f"test order seed: ATE_TEST_SEED={_SEED}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    random.Random(_SEED).shuffle(items)


#: The fixtures that start a real containerd, by the series they run.
CONTAINERD_FIXTURES = {"containerd_16": "1.6", "containerd_17": "1.7", "containerd_21": "2.1"}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per containerd series: how many tests ran on it, passed, failed or were skipped."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if report.when != "call" and not (outcome in ("skipped", "error") and report.when == "setup"):
                continue
            names = set(getattr(report, "fixturenames", ()) or ())
            series = {CONTAINERD_FIXTURES[n] for n in names & CONTAINERD_FIXTURES.keys()}
            for one in series:
                tally = counts.setdefault(one, {})
                tally[outcome] = tally.get(outcome, 0) + 1
    for series in sorted(counts):
        text = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts[series].items()))
        terminalreporter.write_line(f"containerd {series}: {text}")
    for report in terminalreporter.stats.get("passed", []):
        if report.when == "call" and "figures" in report.keywords and report.capstdout.strip():
            terminalreporter.write_line(f"figures of {report.nodeid}:")
            for line in report.capstdout.strip().splitlines():
                terminalreporter.write_line(f"  {line}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each report carries the test's fixture names (the summary above counts runtimes by them)."""
    outcome = yield
    outcome.get_result().fixturenames = tuple(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    func = pyfuncitem.obj
    if not inspect.iscoroutinefunction(func):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    budget = pyfuncitem.get_closest_marker("budget")
    timeout = max(TEST_TIMEOUT, float(budget.args[0])) if budget is not None else TEST_TIMEOUT

    async def run() -> None:
        async with asyncio.timeout(timeout):
            await func(**kwargs)

    asyncio.run(run())
    return True


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    """A directory standing in for ``/``, holding ``dev/kvm`` as a real character node (10:232)."""
    return kvm_dev_root(tmp_path)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A directory standing in for ``/`` for ``FakeKernel``: ``dev/`` exists, nodes live in the kernel's table."""
    root = tmp_path / "fake-root"
    (root / "dev" / "char").mkdir(parents=True)
    (root / "dev" / "char" / "10:232").symlink_to("../kvm")
    return root


@pytest.fixture
def kernel(fake_root: Path) -> FakeKernel:
    """A FakeKernel whose table holds the kvm node at ``fake_root``/dev/kvm."""
    fake = FakeKernel()
    fake.add_node(fake_root / "dev" / "kvm")
    return fake


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "device-plugins"
    path.mkdir(mode=0o750)
    return path


@pytest.fixture
def clean_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    """podman on a throwaway store with the kvmcheck image; skips where it cannot run, or fails (ATE_REQUIRE_PODMAN)."""
    return require_podman(lambda: Podman.prepare(tmp_path_factory.mktemp("podman")))


@pytest.fixture(scope="session")
def cri_images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    """The pause and kvm checker image archives every test containerd imports (built once)."""
    return require_images(tmp_path_factory.mktemp("cri-images"))


@pytest.fixture
def closed_kvm() -> NodeStat:
    """The host's /dev/kvm keeps strangers out (else EACCES could not happen and would prove nothing)."""
    node = NodeStat.of("/dev/kvm")
    assert node.mode & 0o007 == 0, f"the host's /dev/kvm is {node.mode:#o}: open to every user"
    return node


@pytest.fixture
def containerd_17() -> ContainerdBuild:
    """containerd 1.7 (Debian 13's); skips where it cannot run, or fails (ATE_REQUIRE_CONTAINERD)."""
    return require_containerd("1.7")


@pytest.fixture
def containerd_21() -> ContainerdBuild:
    """containerd 2.1 (forky/sid's .deb, unpacked by make runtimes); skips where it cannot run, or fails
    (ATE_REQUIRE_CONTAINERD)."""
    return require_containerd("2.1")


@pytest.fixture
def containerd_16() -> ContainerdBuild:
    """containerd 1.6 (Debian 12's); skips where it cannot run, or fails (ATE_REQUIRE_CONTAINERD)."""
    return require_containerd("1.6")
