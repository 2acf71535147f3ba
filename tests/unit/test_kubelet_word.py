"""KubeletWord against a real pod-resources socket (the fake kubelet's): hints coalesced into few questions,
never polled; a kubelet that cannot answer said once; the sockets that came and went."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import grpc
import pytest

from ate_devplugd._pb.podresources.v1 import api_pb2_grpc as pr_grpc
from ate_devplugd.base.inotify import DirEvent
from ate_devplugd.deviceplugin.offer import Offer, Verdict
from ate_devplugd.kubelet import word as wordmod
from ate_devplugd.kubelet.word import COALESCE_CAP, SETTLE, KubeletWord, Word
from tests.fakes.kubelet import FakeKubelet
from tests.support import recording_events


class Answers:
    """The words a subscriber hears, on a queue."""

    def __init__(self, word: KubeletWord) -> None:
        self.queue: asyncio.Queue[Word] = asyncio.Queue()
        word.subscribe(self.queue.put_nowait)

    async def next(self, timeout: float = 10.0) -> Word:
        async with asyncio.timeout(timeout):
            return await self.queue.get()

    async def none_within(self, seconds: float) -> bool:
        """No word for ``seconds`` (a wait on the queue that must time out)."""
        try:
            await self.next(timeout=seconds)
        except TimeoutError:
            return True
        return False


async def test_a_burst_of_hints_is_one_question(plugin_dir: Path) -> None:
    """Hints in one moment share one question, SETTLE after them; none follows; the answer holds the IDs."""
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    word = KubeletWord(str(plugin_dir))
    answers = Answers(word)
    loop = asyncio.get_running_loop()
    try:
        began = loop.time()
        for _ in range(5):
            word.hint()
        heard = await answers.next()
        assert heard.asked_at - began >= SETTLE * 0.98
        assert heard.offered is not None and heard.offered.ids == {}
        assert await answers.none_within(3 * SETTLE)
        assert word.asked == 1
    finally:
        word.close()
        await kubelet.stop()


async def test_steady_hints_are_asked_about_at_most_every_settle(plugin_dir: Path) -> None:
    """Hints every 50 ms for 2 s: the first question within the coalescing cap, the next ones at least SETTLE
    apart, and one after the last hint (its SETTLE honoured)."""
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    word = KubeletWord(str(plugin_dir))
    answers = Answers(word)
    loop = asyncio.get_running_loop()
    began = loop.time()
    handles = [loop.call_at(began + 0.05 * i, word.hint) for i in range(40)]
    try:
        asked = []
        while not asked or asked[-1] < began + 0.05 * 39 + SETTLE * 0.98:
            asked.append((await answers.next()).asked_at)
        assert asked[0] - began <= COALESCE_CAP + 0.1, asked
        assert all(b - a >= SETTLE * 0.98 for a, b in itertools.pairwise(asked)), asked
        assert len(asked) <= 2.0 / SETTLE + 2, asked
        assert await answers.none_within(2 * SETTLE)
    finally:
        for handle in handles:
            handle.cancel()
        word.close()
        await kubelet.stop()


async def test_a_question_owed_later(plugin_dir: Path) -> None:
    """``hint(delay)`` is asked once that much time has passed, not before."""
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    word = KubeletWord(str(plugin_dir))
    answers = Answers(word)
    loop = asyncio.get_running_loop()
    try:
        began = loop.time()
        word.hint(0.6)
        assert (await answers.next()).asked_at - began >= 0.6 * 0.98
    finally:
        word.close()
        await kubelet.stop()


@pytest.mark.parametrize("gap_ms", [0.5, 2.0, 4.5, 6.0])
async def test_a_change_just_after_another_is_answered(plugin_dir: Path, gap_ms: float) -> None:
    """A Register, then a stream opened or a list sent some milliseconds later (two hints, two changes): the
    question the second hint owes may go out up to EARLY before it is due, and its word must then count for
    that change, or the session would wait for a word that no hint is left to ask for (registered 0 for
    good, kubelet offering our units)."""
    kubelet = FakeKubelet(plugin_dir)
    await kubelet.start()
    word = KubeletWord(str(plugin_dir))
    loop = asyncio.get_running_loop()
    offer = Offer()
    verdict = asyncio.Event()

    def heard(told: Word) -> None:
        if offer.judge(told, "ate.dev/kvm", 4, lambda _: True, loop.time()) is not Verdict.PENDING:
            verdict.set()

    def changed() -> None:
        offer.changed(loop.time())
        word.hint()

    word.subscribe(heard)
    try:
        offer.registered(loop.time(), None)
        word.hint()
        loop.call_later(gap_ms / 1000, changed)
        async with asyncio.timeout(SETTLE + COALESCE_CAP + 2.0):
            await verdict.wait()
        assert offer.verdict is Verdict.NOT_HELD  # the fake kubelet offers nothing of the name
        assert word.asked <= 2
    finally:
        word.close()
        await kubelet.stop()


async def test_no_socket_is_asked_again_a_few_times_then_said_once(
    plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pod-resources socket (a kubelet starting, or none): asked again RETRIES times, then one warning;
    a later burst asks again but says it no more; its answer later is said once."""
    monkeypatch.setattr(wordmod, "RETRY_FIRST", 0.01)
    word = KubeletWord(str(plugin_dir))
    answers = Answers(word)
    with recording_events() as events:
        word.hint()
        for _ in range(wordmod.RETRIES + 1):
            assert (await answers.next()).offered is None
        record = await events.wait_for("pod-resources-unanswered")
        while record.levelno != logging.WARNING:
            record = await events.wait_for("pod-resources-unanswered")
        assert "does not answer" in record.getMessage()
        assert await answers.none_within(3 * SETTLE)
        word.hint()
        for _ in range(wordmod.RETRIES + 1):
            await answers.next()
        loud = [r for r in events.named("pod-resources-unanswered") if r.levelno >= logging.WARNING]
        assert len(loud) == 1, events.text()
        kubelet = FakeKubelet(plugin_dir)
        await kubelet.start()
        try:
            word.hint()
            assert (await answers.next()).offered is not None
            word.hint()
            await answers.next()
            assert len(events.named("pod-resources-answers")) == 1, events.text()
        finally:
            word.close()
            await kubelet.stop()


async def test_an_older_kubelet_is_not_asked_again(plugin_dir: Path) -> None:
    """A pod-resources API without GetAllocatableResources (UNIMPLEMENTED): warned at once, not retried."""
    path = plugin_dir.parent / "pod-resources" / "kubelet.sock"
    path.parent.mkdir()
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(pr_grpc.PodResourcesListerServicer(), server)
    server.add_insecure_port("unix://" + str(path))
    await server.start()
    word = KubeletWord(str(plugin_dir))
    answers = Answers(word)
    try:
        with recording_events() as events:
            word.hint()
            assert (await answers.next()).offered is None
            record = await events.wait_for("pod-resources-unanswered")
            assert record.levelno == logging.WARNING and "UNIMPLEMENTED" in record.getMessage()
            assert await answers.none_within(3 * SETTLE)
    finally:
        word.close()
        await server.stop(None)


async def test_sockets_that_came_and_went(plugin_dir: Path) -> None:
    """Each word carries when the sockets that left since the last question had come (-inf: before the word
    saw them), once; kubelet.sock and the checkpoint are not other plugins."""
    word = KubeletWord(str(plugin_dir), api=False)
    answers = Answers(word)
    loop = asyncio.get_running_loop()
    try:
        came = loop.time()
        word.seen([DirEvent("created", "gpu.sock"), DirEvent("created", "kubelet_internal_checkpoint")])
        word.seen(
            [DirEvent("removed", "gpu.sock"), DirEvent("removed", "old.sock"), DirEvent("removed", "kubelet.sock")]
        )
        heard = await answers.next()
        assert len(heard.departed) == 2 and heard.departed[0] >= came and heard.departed[1] == float("-inf")
        assert heard.offered is None and heard.recorded is None
        word.hint()
        assert (await answers.next()).departed == ()
    finally:
        word.close()
