"""``switch-mode``'s waits on the API server: until what it lists is right, listed again on each event of a
watch of the same objects (no polling), for at most a timeout. An API server that does not answer is
waited for within the same timeout (its list tried again after a back-off, said once): a move outlives
a restart of the API server, and one that stays away ends the wait as any other reason would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

from ate_devplugd.commands.switch_files import SwitchFailed
from ate_devplugd.dra.apiclient import ApiClient, ApiError, ApiUnavailable

#: Seconds before a watch that ended is made again.
REWATCH = 0.5


class Wait(NamedTuple):
    """One wait: what it waits for (in the failure), for how long, what it says of each new reason it
    waits, and how long the objects must be right before it ends (``hold``)."""

    what: str
    timeout: float
    waiting: Callable[[str], None]
    hold: float = 0.0


async def until(
    api: ApiClient, path: str, selector: str, wrong: Callable[[list[dict[str, Any]]], str | None], wait: Wait
) -> None:
    """Until ``wrong`` of the objects listed at ``path`` (``selector``) is None for ``wait.hold`` seconds;
    SwitchFailed after ``wait.timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait.timeout
    changed = asyncio.Event()

    async def follow() -> None:
        while True:
            with contextlib.suppress(ApiError, ApiUnavailable):
                async for _ in api.watch(path, {"fieldSelector": selector, "timeoutSeconds": "300"}):
                    changed.set()
            await asyncio.sleep(REWATCH)  # the back-off before the watch is made again

    watcher = loop.create_task(follow())
    good_since: float | None = None
    said = None
    try:
        while True:
            changed.clear()
            try:
                items = (await api.request("GET", path, params={"fieldSelector": selector})).get("items") or []
                why, now = wrong(items), loop.time()
            except ApiUnavailable as exc:
                why, now = "the API server does not answer", loop.time()
                good_since = None
                if why != said:
                    wait.waiting(f"{why} ({exc})")
                    said = why
                if now >= deadline:
                    raise SwitchFailed(f"{wait.what}: not within {wait.timeout:g} s: {why} ({exc})") from None
                await asyncio.sleep(min(REWATCH, deadline - now))  # the back-off before it is asked again
                continue
            if why is None:
                good_since = now if good_since is None else good_since
                if now - good_since >= wait.hold:
                    return
                wake = good_since + wait.hold
            else:
                good_since, wake = None, deadline
                if why != said:
                    wait.waiting(why)
                    said = why
            if now >= deadline:
                raise SwitchFailed(f"{wait.what}: not within {wait.timeout:g} s: {why}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(wake, deadline) - now):
                    await changed.wait()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
