"""A small asyncio client for the few Kubernetes API calls DRA mode makes (aiohttp, JSON only).

Every call runs on the loop. An API server named by IP address is reached without any thread; a host
name is resolved by asyncio's getaddrinfo, which runs in the loop's default executor (as for any
asyncio connection) and hands the answer back to the loop.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp

from ate_devplugd.dra.kubeconfig import Credentials

log = logging.getLogger(__name__)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NODES = "/api/v1/nodes"
PODS = "/api/v1/pods"
#: A single request (not a watch) that takes longer than this has failed.
REQUEST_TIMEOUT = 15.0
_USER_AGENT = "ate-devplugd"


class ApiErrorKind(enum.Enum):
    """A failed call, by what the API server answered (the ``reason`` of the API error counter)."""

    UNREACHABLE = "unreachable"  # no answer: refused, timed out, a broken connection
    UNAUTHORIZED = "unauthorized"  # 401
    FORBIDDEN = "forbidden"  # 403
    NOT_FOUND = "not_found"  # 404
    CONFLICT = "conflict"  # 409
    INVALID = "invalid"  # 422
    THROTTLED = "throttled"  # 429
    SERVER_ERROR = "server_error"  # 5xx
    OTHER = "other"

    @classmethod
    def of_status(cls, status: int) -> ApiErrorKind:
        by_status = {401: cls.UNAUTHORIZED, 403: cls.FORBIDDEN, 404: cls.NOT_FOUND, 409: cls.CONFLICT}
        by_status |= {422: cls.INVALID, 429: cls.THROTTLED}
        return by_status.get(status, cls.SERVER_ERROR if status >= 500 else cls.OTHER)


class ApiError(Exception):
    """The API server answered with an error status (``status``, its Status ``reason`` and message)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message


class ApiUnavailable(Exception):
    """The API server could not be reached, or the connection broke."""


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"


def node_path(name: str) -> str:
    return f"{NODES}/{quote(name, safe='')}"


def slice_path(name: str) -> str:
    return f"{SLICES}/{quote(name, safe='')}"


class ApiClient:
    """One connection pool to the API server, with the credentials it was built from."""

    def __init__(self, credentials: Credentials, on_error: Callable[[ApiErrorKind], None] | None = None) -> None:
        self.credentials = credentials
        #: Told of every call that failed (the metrics count them).
        self._on_error = on_error
        headers = {"Accept": "application/json", "User-Agent": _USER_AGENT, **credentials.headers}
        connector = aiohttp.TCPConnector(ssl=credentials.ssl_context or False, limit=8)
        self._session = aiohttp.ClientSession(
            connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; returns the decoded JSON object, raises ApiError or ApiUnavailable. ``content_type``:
        the body's (``application/merge-patch+json`` for a PATCH)."""
        url = self.credentials.server + path
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        headers = {} if data is None else {"Content-Type": content_type}
        try:
            async with self._session.request(
                method,
                url,
                data=data,
                params=params,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._failed(ApiErrorKind.UNREACHABLE)
            raise ApiUnavailable(f"{method} {path}: {_describe(exc)}") from None
        decoded = _decode(raw)
        if status >= 300:
            self._failed(ApiErrorKind.of_status(status))
            raise _error(status, decoded, raw)
        if not isinstance(decoded, dict):
            self._failed(ApiErrorKind.OTHER)
            raise ApiUnavailable(f"{method} {path}: the answer is not a JSON object")
        return decoded

    def _failed(self, kind: ApiErrorKind) -> None:
        if self._on_error is not None:
            self._on_error(kind)

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (``watch=1`` is added), one decoded JSON object each, until it ends."""
        url = self.credentials.server + path
        query = {**params, "watch": "1"}
        try:
            async with self._session.get(
                url, params=query, timeout=aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT)
            ) as response:
                if response.status >= 300:
                    raw = await response.read()
                    self._failed(ApiErrorKind.of_status(response.status))
                    raise _error(response.status, _decode(raw), raw)
                while True:
                    line = await response.content.readline()
                    if not line:
                        return
                    if not line.strip():
                        continue
                    event = _decode(line)
                    if not isinstance(event, dict):
                        self._failed(ApiErrorKind.OTHER)
                        raise ApiUnavailable(f"watch {path}: an event is not a JSON object")
                    yield event
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._failed(ApiErrorKind.UNREACHABLE)
            raise ApiUnavailable(f"watch {path}: {_describe(exc)}") from None


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error(status: int, decoded: Any, raw: bytes) -> ApiError:
    if isinstance(decoded, dict) and decoded.get("kind") == "Status":
        return ApiError(status, str(decoded.get("reason", "")), str(decoded.get("message", "")))
    text = raw[:200].decode("utf-8", "replace").strip()
    return ApiError(status, "", text)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
