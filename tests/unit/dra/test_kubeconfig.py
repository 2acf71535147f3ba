"""Reading kubeconfigs: kubelet's file-based one, inline data, tokens, and clear errors."""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd.dra import kubeconfig
from tests.fakes.certs import Pki, make_pki


def write(path: Path, cluster: dict[str, Any], user: dict[str, Any], **top: Any) -> str:
    doc = {
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
        **top,
    }
    path.write_text(json.dumps(doc))
    return str(path)


class TestLoad:
    def test_files_relative_to_kubeconfig(self, tmp_path: Path) -> None:
        """Certificate paths are relative to the kubeconfig's directory, as kubectl reads them."""
        make_pki(tmp_path)
        path = write(
            tmp_path / "kc",
            {"server": "https://127.0.0.1:6443/", "certificate-authority": "ca.crt"},
            {"client-certificate": "client.crt", "client-key": "client.key"},
        )
        creds = kubeconfig.load(path)
        assert creds.server == "https://127.0.0.1:6443"
        assert isinstance(creds.ssl_context, ssl.SSLContext)
        assert creds.ssl_context.verify_mode == ssl.CERT_REQUIRED
        assert creds.headers == {}

    def test_inline_data_and_token_file(self, tmp_path: Path) -> None:
        """*-data fields are base64 PEM; tokenFile is read for the bearer token."""
        pki = make_pki(tmp_path / "pki")
        (tmp_path / "token").write_text("abc\n")

        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        path = write(
            tmp_path / "kc",
            {"server": "https://h:1", "certificate-authority-data": b64(pki.ca)},
            {
                "client-certificate-data": b64(pki.client_cert),
                "client-key-data": b64(pki.client_key),
                "tokenFile": "token",
            },
        )
        assert kubeconfig.load(path).headers == {"Authorization": "Bearer abc"}

    def test_single_context_without_current(self, tmp_path: Path) -> None:
        """With one context and no current-context, that context is used."""
        path = write(tmp_path / "kc", {"server": "http://127.0.0.1:8080"}, {"token": "t"}, **{"current-context": ""})
        assert kubeconfig.load(path).ssl_context is None


def handshake(client: ssl.SSLContext, pki: Pki) -> None:
    """A TLS handshake in memory between ``client`` and a server with ``pki``'s certificate for 127.0.0.1."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pki.server_cert, pki.server_key)
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(to_client, to_server, server_hostname="127.0.0.1")
    s = server.wrap_bio(to_server, to_client, server_side=True)
    done = set()
    for _ in range(10):
        for end in (c, s):
            if end not in done:
                try:
                    end.do_handshake()
                    done.add(end)
                except ssl.SSLWantReadError:
                    pass
        if c in done:
            return
    raise AssertionError("the handshake did not finish")


class TestTrust:
    def test_named_ca_trusted_alone(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A kubeconfig naming a CA trusts that CA alone: a server certificate of another CA is refused,
        even one the system trusts."""
        ours, other = make_pki(tmp_path / "ours"), make_pki(tmp_path / "other")
        monkeypatch.setenv("SSL_CERT_FILE", str(other.ca))  # the system's trust store: the other CA
        path = write(tmp_path / "kc", {"server": "https://127.0.0.1:6443", "certificate-authority": str(ours.ca)}, {})
        context = kubeconfig.load(path).ssl_context
        assert context is not None and context.check_hostname
        assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "ate-devplugd test CA"),),)]
        handshake(context, ours)
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(context, other)

    def test_no_ca_trusts_the_system(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a CA in the kubeconfig, the system's CAs are trusted."""
        system = make_pki(tmp_path / "system")
        monkeypatch.setenv("SSL_CERT_FILE", str(system.ca))
        context = kubeconfig.load(write(tmp_path / "kc", {"server": "https://127.0.0.1:6443"}, {})).ssl_context
        assert context is not None
        handshake(context, system)


class TestErrors:
    @pytest.mark.parametrize(
        ("cluster", "user", "expected"),
        [
            ({"server": "127.0.0.1:6443"}, {}, "cluster server: '127.0.0.1:6443' must be an https:// URL"),
            ({"server": "https://h", "certificate-authority": "missing.crt"}, {}, "missing.crt: no such file"),
            (
                {"server": "https://h", "certificate-authority-data": "%%%"},
                {},
                "certificate-authority-data: not valid base64",
            ),
            ({"server": "https://h"}, {"client-certificate": "c.crt"}, "c.crt: no such file"),
            ({"server": "https://h"}, {"exec": {"command": "x"}}, "user 'exec': not supported"),
            ({"server": "https://h"}, {"tokenFile": "nope"}, "nope: no such file"),
        ],
    )
    def test_one_clear_line(self, tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], expected: str) -> None:
        """Each problem is one line naming the file and the field."""
        path = write(tmp_path / "kc", cluster, user)
        with pytest.raises(kubeconfig.KubeconfigError) as info:
            kubeconfig.load(path)
        assert str(info.value).startswith(path + ": ") and expected in str(info.value)
        assert "\n" not in str(info.value)

    def test_missing_file_and_bad_yaml(self, tmp_path: Path) -> None:
        """A missing file or broken YAML says so, on one line."""
        with pytest.raises(kubeconfig.KubeconfigError) as missing:
            kubeconfig.load(str(tmp_path / "none"))
        assert str(missing.value) == f"{tmp_path / 'none'}: no such file"  # never "[Errno 2] ..."
        (tmp_path / "kc").write_text("clusters: [\n  - {")
        with pytest.raises(kubeconfig.KubeconfigError, match="not valid YAML") as info:
            kubeconfig.load(str(tmp_path / "kc"))
        assert "\n" not in str(info.value)

    def test_unknown_context(self, tmp_path: Path) -> None:
        """A current-context that names nothing is reported."""
        path = write(tmp_path / "kc", {"server": "https://h"}, {}, **{"current-context": "other"})
        with pytest.raises(kubeconfig.KubeconfigError, match="context 'other'"):
            kubeconfig.load(path)

    def test_empty_ca_file(self, tmp_path: Path) -> None:
        """An empty CA file is an error naming the field, not a fall-back to the system's CAs."""
        (tmp_path / "ca.crt").write_text("")
        path = write(tmp_path / "kc", {"server": "https://h", "certificate-authority": "ca.crt"}, {})
        with pytest.raises(kubeconfig.KubeconfigError, match="certificate-authority: not a PEM certificate"):
            kubeconfig.load(path)

    def test_key_without_certificate(self, tmp_path: Path) -> None:
        """A client key without its certificate is an error."""
        pki = make_pki(tmp_path)
        path = write(tmp_path / "kc", {"server": "https://h"}, {"client-key": str(pki.client_key)})
        with pytest.raises(kubeconfig.KubeconfigError, match="given together"):
            kubeconfig.load(path)
