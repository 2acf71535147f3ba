"""Debian's Prometheus tools for tests: a real ``prometheus-node-exporter`` serving only the textfile
collector on 127.0.0.1, and ``promtool``; and the writes of a metrics file seen through inotify.

A test that needs a tool skips when it is not installed, unless ``ATE_REQUIRE_PROMETHEUS_TOOLS=1``
(``make test`` sets it, having installed them): then it fails, so a CI run cannot pass by skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.filewait import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    DirWatch,
)

REQUIRE_ENV = "ATE_REQUIRE_PROMETHEUS_TOOLS"
NODE_EXPORTER = "prometheus-node-exporter"
PROMTOOL = "promtool"
_PACKAGES = {NODE_EXPORTER: "prometheus-node-exporter", PROMTOOL: "prometheus"}
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


def require_tool(name: str) -> str:
    """The tool's path; skip the test if it is missing, or fail if ``ATE_REQUIRE_PROMETHEUS_TOOLS=1``."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install {_PACKAGES.get(name, name)})"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{msg}, and {REQUIRE_ENV}=1")
        pytest.skip(msg)
    return path


class NodeExporter:
    """``prometheus-node-exporter`` with only the textfile collector, reading ``textfile_dir``.

    It listens on 127.0.0.1 port 0: the kernel picks a free port and the exporter's own "Listening on"
    log line names it, so start-up waits on that line (no port probing, no race for a port).
    """

    def __init__(self, textfile_dir: Path) -> None:
        self.textfile_dir = textfile_dir
        self.address = ""
        self.log: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    async def start(self, timeout: float = 10.0) -> None:
        binary = require_tool(NODE_EXPORTER)
        self._proc = await asyncio.create_subprocess_exec(
            binary,
            "--web.listen-address=127.0.0.1:0",
            "--collector.disable-defaults",
            "--collector.textfile",
            f"--collector.textfile.directory={self.textfile_dir}",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self._proc.stderr is not None
        try:
            async with asyncio.timeout(timeout):
                await self._wait_listening(self._proc.stderr)
        except BaseException:
            await self.stop()
            raise
        # keep reading its log, so that a full pipe never stalls it
        self._drain = asyncio.get_running_loop().create_task(self._read_log(self._proc.stderr))
        # the line is logged once the socket listens; one connect proves it
        host, port = self.address.rsplit(":", 1)
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    async def _wait_listening(self, stream: asyncio.StreamReader) -> None:
        while not self.address:
            line = await stream.readline()
            if not line:
                raise RuntimeError(f"{NODE_EXPORTER} exited at start:\n" + "".join(self.log))
            self.log.append(line.decode(errors="replace"))
            if match := _LISTENING.search(self.log[-1]):
                self.address = match.group(1)

    async def _read_log(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.log.append(line.decode(errors="replace"))

    async def scrape(self, timeout: float = 10.0) -> str:
        """GET /metrics (in a thread: urllib blocks) and return the text."""

        def get() -> str:
            with urllib.request.urlopen(self.url, timeout=timeout) as response:
                body: bytes = response.read()
                return body.decode()

        return await asyncio.to_thread(get)

    async def families(self) -> dict[str, Metric]:
        """The scraped metric families by name (counters without their ``_total``)."""
        return {family.name: family for family in text_string_to_metric_families(await self.scrape())}

    async def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._drain is not None:
            await self._drain
            self._drain = None


@contextlib.asynccontextmanager
async def node_exporter(textfile_dir: Path) -> AsyncIterator[NodeExporter]:
    exporter = NodeExporter(textfile_dir)
    await exporter.start()
    try:
        yield exporter
    finally:
        await exporter.stop()


def sample(families: dict[str, Metric], name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels`` (KeyError if there is none)."""
    for family in families.values():
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels}")


async def promtool(*args: str, stdin: bytes | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """Run ``promtool ARGS`` (stdin piped when given); its exit status and output (stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        require_tool(PROMTOOL),
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout):
            out, _ = await proc.communicate(stdin)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


class FileEvents:
    """Real inotify on a directory, on the loop: the events about one file name, queued; renames onto it
    counted."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.renames = 0
        mask = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_MODIFY | IN_CLOSE_WRITE
        self._watch = DirWatch(directory, mask)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._watch.fd, self._on_events)

    def _on_events(self) -> None:
        for mask, name in self._watch.events():
            if name == self.name:
                self.renames += bool(mask & IN_MOVED_TO)
                self.queue.put_nowait(mask)

    async def renamed(self, timeout: float = 5.0) -> None:
        """Wait for the next rename onto the file; any other event on its name fails the test."""
        async with asyncio.timeout(timeout):
            mask = await self.queue.get()
        assert mask == IN_MOVED_TO, f"the file itself was written in place (mask {mask:#x})"

    def close(self) -> None:
        self._loop.remove_reader(self._watch.fd)
        self._watch.close()


@contextlib.contextmanager
def watching(directory: Path, name: str) -> Iterator[FileEvents]:
    events = FileEvents(directory, name)
    try:
        yield events
    finally:
        events.close()
