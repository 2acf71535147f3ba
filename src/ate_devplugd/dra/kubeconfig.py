"""Read a kubeconfig (kubelet's own ``kubelet.conf`` by default) into what an HTTPS client needs.

The slice publisher reads it once per session, so again at every retry and every watch renewal:
kubelet rotates its client certificate in place, and an administrator may fix a broken file while
the daemon keeps retrying. Certificates given inline (``*-data``) are handed to OpenSSL through
memfds, never written to disk.

Every file read for a kubeconfig (the kubeconfig itself, its token file, certificates and keys) is
listed with a digest of the bytes read (``Credentials.sources``, ``KubeconfigError.sources``), so that
``credentials.CredentialFiles`` can tell when any of them changed since.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import os
import posixpath
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


#: A file read for the credentials and the digest of what was read (None: it could not be read).
Source = tuple[str, "str | None"]


class KubeconfigError(Exception):
    """The kubeconfig cannot be used; the message names the file and the field."""

    def __init__(self, message: str, sources: tuple[Source, ...] = ()) -> None:
        super().__init__(message)
        #: The files read before the error (the one that could not be read among them).
        self.sources = sources


@dataclass(frozen=True)
class Credentials:
    """The API server's address and how to authenticate to it."""

    server: str
    ssl_context: ssl.SSLContext | None
    headers: Mapping[str, str] = field(default_factory=dict)
    #: The files these credentials were read from, each with the digest of the bytes read.
    sources: tuple[Source, ...] = ()

    @property
    def token(self) -> bool:
        """Whether a bearer token authenticates (else a client certificate, or nothing)."""
        return "Authorization" in self.headers


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unreadable(exc: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in words (``no such file``), never ``[Errno 2] ...``."""
    if isinstance(exc, UnicodeDecodeError):
        return f"cannot read: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
    if exc.errno == errno.ENOENT:
        return "no such file"
    return f"cannot read: {(exc.strerror or str(exc)).lower()}"


def file_digest(path: str) -> str | None:
    """The digest of ``path``'s bytes now, or None if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return digest(fh.read())
    except OSError:
        return None


class _Files:
    """Reads the files of one kubeconfig, keeping each one's digest."""

    def __init__(self) -> None:
        self.read: dict[str, str | None] = {}

    def bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            self.read[path] = None
            raise
        self.read[path] = digest(data)
        return data

    def sources(self) -> tuple[Source, ...]:
        return tuple(self.read.items())


def load(path: str) -> Credentials:
    """Parse ``path`` into Credentials; raises KubeconfigError with one clear line."""
    files = _Files()
    try:
        return _load(path, files)
    except KubeconfigError as exc:
        raise KubeconfigError(str(exc), files.sources()) from None


def _load(path: str, files: _Files) -> Credentials:
    try:
        text = files.bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KubeconfigError(f"{path}: {unreadable(exc)}") from None
    try:
        doc = yaml.load(text, Loader=_LOADER)  # a safe loader (C if available)
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise KubeconfigError(f"{path}: not a kubeconfig (expected a mapping at the top)")
    return _credentials(path, doc, files)


def _named(path: str, doc: Mapping[str, Any], kind: str, name: str) -> Mapping[str, Any]:
    entries = doc.get(kind + "s") or []
    if isinstance(entries, list):
        for entry in entries:
            if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(kind), dict):
                return entry[kind]  # type: ignore[no-any-return]
    raise KubeconfigError(f"{path}: {kind} {name!r} (named by the current context) is not in {kind}s")


def _context_name(path: str, doc: Mapping[str, Any]) -> str:
    current = doc.get("current-context")
    if isinstance(current, str) and current:
        return current
    contexts = doc.get("contexts") or []
    if isinstance(contexts, list) and len(contexts) == 1 and isinstance(contexts[0], dict):
        return str(contexts[0].get("name", ""))
    raise KubeconfigError(f"{path}: current-context is not set")


def _credentials(path: str, doc: Mapping[str, Any], files: _Files) -> Credentials:
    context = _named(path, doc, "context", _context_name(path, doc))
    cluster = _named(path, doc, "cluster", str(context.get("cluster", "")))
    user = _named(path, doc, "user", str(context.get("user", ""))) if context.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigError(f"{path}: cluster server: {server!r} must be an https:// URL")
    for unsupported in ("exec", "auth-provider", "username"):
        if unsupported in user:
            raise KubeconfigError(f"{path}: user {unsupported!r}: not supported (use a client certificate or a token)")
    if "tls-server-name" in cluster:
        raise KubeconfigError(f"{path}: cluster tls-server-name: not supported")
    base = posixpath.dirname(posixpath.abspath(path))
    headers = _auth_headers(path, base, user, files)
    if server.startswith("http://"):
        return Credentials(server.rstrip("/"), None, headers, files.sources())
    context_ssl = _server_trust(path, base, cluster, files)
    cert = _pem(path, base, user, "client-certificate", files)
    key = _pem(path, base, user, "client-key", files)
    if (cert is None) != (key is None):
        raise KubeconfigError(f"{path}: user: client-certificate and client-key must be given together")
    if cert is not None and key is not None:
        with _memfd(cert) as cert_path, _memfd(key) as key_path:
            try:
                context_ssl.load_cert_chain(cert_path, key_path)
            except ssl.SSLError as exc:
                raise KubeconfigError(f"{path}: user: client certificate or key unusable ({exc.reason})") from None
    return Credentials(server.rstrip("/"), context_ssl, headers, files.sources())


def _server_trust(path: str, base: str, cluster: Mapping[str, Any], files: _Files) -> ssl.SSLContext:
    """The TLS context toward the API server: the kubeconfig's CA alone when it names one (as client-go
    trusts it), the system's CAs only when it names none. Given ``cadata``, create_default_context keeps
    the runtime's default checks and loads that CA only, not the system's store (~20 ms on the loop)."""
    if cluster.get("insecure-skip-tls-verify") is True:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    ca = _pem(path, base, cluster, "certificate-authority", files)
    if ca is None:
        return ssl.create_default_context()
    text = ca.decode("ascii", "replace")
    if not text:  # create_default_context would take an empty CA for none and load the system's
        raise KubeconfigError(f"{path}: certificate-authority: not a PEM certificate (empty)")
    try:
        return ssl.create_default_context(cadata=text)
    except ssl.SSLError as exc:
        raise KubeconfigError(f"{path}: certificate-authority: not a PEM certificate ({exc.reason})") from None


def _auth_headers(path: str, base: str, user: Mapping[str, Any], files: _Files) -> dict[str, str]:
    token = user.get("token")
    if "tokenFile" in user and not token:
        token_path = posixpath.join(base, str(user["tokenFile"]))
        try:
            token = files.bytes(token_path).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise KubeconfigError(f"{path}: user tokenFile: {token_path}: {unreadable(exc)}") from None
    if token is None:
        return {}
    if not isinstance(token, str) or not token or not token.isprintable():
        raise KubeconfigError(f"{path}: user token: must be a non-empty string")
    return {"Authorization": "Bearer " + token}


def _pem(path: str, base: str, section: Mapping[str, Any], key: str, files: _Files) -> bytes | None:
    """The PEM bytes of ``key-data`` (base64) or of the file ``key`` (relative to the kubeconfig)."""
    data = section.get(key + "-data")
    if data:
        try:
            return base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError):
            raise KubeconfigError(f"{path}: {key}-data: not valid base64") from None
    name = section.get(key)
    if not name:
        return None
    file_path = posixpath.join(base, str(name))
    try:
        return files.bytes(file_path)
    except OSError as exc:
        raise KubeconfigError(f"{path}: {key}: {file_path}: {unreadable(exc)}") from None


@contextlib.contextmanager
def _memfd(data: bytes) -> Iterator[str]:
    """``data`` as a path OpenSSL can open, backed by memory only."""
    fd = os.memfd_create("ate-devplugd-kubeconfig", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
