"""The heap's trim after a burst (``base.malloc.Trim``): one per burst, after its last piece of work."""

from __future__ import annotations

import asyncio

from ate_devplugd.base.malloc import Trim


async def test_a_burst_is_trimmed_once_and_now_takes_a_pending_trim() -> None:
    trims: asyncio.Queue[float] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    trim = Trim(delay=0.01, call=lambda: trims.put_nowait(loop.time()))
    for _ in range(100):  # a burst: the pokes after the first ride along
        trim.poke()
    async with asyncio.timeout(5):
        await trims.get()
    trim.poke()  # work after the trim schedules the next one
    trim.now()  # a coalesced step that ends the burst: the pending one is taken, not run again
    assert trims.qsize() == 1
    trims.get_nowait()
    trim.poke()
    async with asyncio.timeout(5):
        await trims.get()
    trim.close()
    assert trims.empty()


def test_glibc_s_trim_is_found() -> None:
    trim = Trim()
    trim.now()  # returns the free pages; never raises
    trim.close()
