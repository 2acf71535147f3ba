"""Every use of grpcio's private API, in one place: check this module on each grpcio upgrade.

- ``grpc._cython.cygrpc.init_grpc_aio`` / ``shutdown_grpc_aio``: the reference count on grpc.aio's
  runtime that every channel and server takes (grpcio 1.51 to 1.85 at least).
- ``grpc._cython.cygrpc.ExecuteBatchError`` and the text grpcio logs it with on the logger
  ``grpc._cython.cygrpc`` (``aio/server.pyx.pxi``, ``_handle_exceptions``): a stream's message or final
  status that could not be sent because kubelet or the server went first.

Where a name is missing, the feature falls back to public behaviour (an idle channel holds the
runtime; nothing is recognised as a teardown race) and ``tests/unit/test_grpc_compat.py`` fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

_CYGRPC = importlib.import_module("grpc._cython.cygrpc")
#: grpcio's error for a batch of operations on a call that failed (absent, nothing matches).
EXECUTE_BATCH_ERROR: type[BaseException] | tuple[()] = getattr(_CYGRPC, "ExecuteBatchError", ())
#: The logger grpcio's server reports an uncaught ExecuteBatchError on, and the start of that report.
CYGRPC_LOGGER = "grpc._cython.cygrpc"
_BATCH_REPORT = "ExecuteBatchError raised in core by servicer method"

TEARDOWN_RACE = "a stream ended as kubelet or the server went away (its last message or status was not sent)"


def runtime_hook_available() -> bool:
    """Whether grpcio exposes the runtime's reference count (else an idle channel stands in)."""
    return callable(getattr(_CYGRPC, "init_grpc_aio", None)) and callable(getattr(_CYGRPC, "shutdown_grpc_aio", None))


class _TeardownRaceFilter(logging.Filter):
    """grpcio's traceback for a send cut off by a departing peer becomes one debug line of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_BATCH_REPORT):
            log.debug("%s [%s]", TEARDOWN_RACE, record.msg[len(_BATCH_REPORT) :].strip(" []"))
            return False
        return True


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # The same race, raised in grpcio's own task for the RPC, where nothing of ours can catch it.
    if isinstance(context.get("exception"), EXECUTE_BATCH_ERROR):
        log.debug("%s", TEARDOWN_RACE)
        return
    loop.default_exception_handler(context)


@contextlib.asynccontextmanager
async def grpc_runtime() -> AsyncIterator[None]:
    """Hold grpc.aio's runtime for the daemon's life, and report its teardown races as debug lines.

    grpc.aio starts its runtime (a poller thread, a completion queue) with the first channel or server
    and shuts it down when the last one closes. Between one kubelet's departure and the next
    registration the daemon can have neither, so every kubelet restart would stop the poller thread and
    start another (a storm of 1,000 restarts costs about 15 % more CPU that way).

    A stream cut off by a departing kubelet, or by a stop, can make grpcio report an error with a
    traceback, from its own task or on its own logger; it can come at any kubelet restart and would
    look like a fault to an operator reading the journal. Anything else keeps its usual report.
    """
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(_loop_exception)
    races = _TeardownRaceFilter()
    cygrpc_log = logging.getLogger(CYGRPC_LOGGER)
    cygrpc_log.addFilter(races)
    try:
        async with _runtime_held():
            yield
    finally:
        cygrpc_log.removeFilter(races)
        loop.set_exception_handler(previous)


@contextlib.asynccontextmanager
async def _runtime_held() -> AsyncIterator[None]:
    """A reference on the runtime, as each channel and server takes one.

    Without that hook an idle channel that never connects does the same, at a cost: on grpcio 1.51 it
    wakes gRPC's timer thread about once a second more when idle.
    """
    if runtime_hook_available():
        _CYGRPC.init_grpc_aio()
        try:
            yield
        finally:
            _CYGRPC.shutdown_grpc_aio()
    else:
        async with grpc.aio.insecure_channel("unix:" + os.devnull):
            yield
