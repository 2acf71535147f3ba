"""DRA mode's credentials: the API server's first answers after it returns (401 and 403 for a moment),
prepares that do not wait for the slice publisher, and a node-bound token renewed in its file while the
daemon runs (real HTTP to the fake API server, real gRPC from the fake kubelet, real inotify)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from pathlib import Path

import pytest

from ate_devplugd.commands.doctor import dra as doctor
from ate_devplugd.commands.findings import Level
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.dra import reconnect
from ate_devplugd.dra.slices import SliceState
from tests.fakes.apiserver import FakeApiServer
from tests.integration.dra_rig import DRIVER, NODE, POOL, Rig, rig, write_kubeconfig, write_token
from tests.support import kvm_config

#: The publisher's back-off as the daemon runs it (DraDriver's default): 0.5 s, doubling up to 30 s.
DAEMON_BACKOFF = (0.5, 30.0)
#: What a just-started API server answers while its informers sync: which switch of the fake, and the status.
STARTING = {"403": "authorizers_ready", "401": "authenticators_ready"}


def delays(records: list[logging.LogRecord]) -> list[float]:
    """The retry delays the records announce ("retrying in 0.73 s")."""
    return [float(m[1]) for r in records if (m := re.search(r"retrying in ([0-9.]+) s", r.getMessage()))]


async def node_lookups(r: Rig, count: int) -> None:
    """Until the driver has asked for its Node ``count`` more times (each connection starts so)."""
    for _ in range(count):
        await r.api.next_request("GET /api/v1/nodes", timeout=10)


async def outage(r: Rig, failures: int) -> None:
    """Stop the API server until the publisher has failed ``failures`` times (its back-off grows with them)."""
    before = len(r.log.events("dra-api-error"))
    await r.api.stop()
    await r.log.wait_events("dra-api-error", before + failures, timeout=30)
    while not r.api.arrivals.empty():  # what came before the outage
        r.api.arrivals.get_nowait()


class TestAfterTheApiServerReturns:
    @pytest.mark.parametrize("status", ["403", "401"])
    async def test_refusals_of_a_starting_api_server_are_retried_within_a_second(self, status: str) -> None:
        """An outage long enough for the back-off to reach 30 s, then an API server that refuses the
        service account for a while (403: its authorization not loaded; 401: its authenticators): the
        refusals are retried about every second, the slice is published and a prepare sent during the
        refusals succeeds within a couple of seconds of them stopping, not after the 30 s back-off."""
        async with rig(credentials="service-account", backoff=DAEMON_BACKOFF) as r:
            await r.kubelet.next_event("registered")
            await r.published()
            claim = r.api.add_claim("ns", "vm", [{"request": "kvm", "driver": DRIVER, "pool": POOL, "device": "kvm-0"}])
            await outage(r, 7)  # 0.5, 1, 2, 4, 8, 16, 30: the next delay would be 30 s
            setattr(r.api, STARTING[status], False)
            r.forget()
            seen = len(r.log.records)
            await r.api.start()
            loop = asyncio.get_running_loop()
            prepare = asyncio.ensure_future(r.kubelet.prepare(DRIVER, ("ns", claim, "vm")))
            prepared_at: list[float] = []
            prepare.add_done_callback(lambda _: prepared_at.append(loop.time()))
            await node_lookups(r, 3)  # three connections refused (about 1.5-3 s of refusals)
            assert not prepare.done()
            refused = r.log.records[seen:]
            ready = loop.time()
            setattr(r.api, STARTING[status], True)
            await r.status(lambda s: s.slices is SliceState.PUBLISHED, timeout=10)
            published = loop.time() - ready
            response = await asyncio.wait_for(prepare, 10)
            took = prepared_at[0] - ready
            retries = delays([x for x in refused if getattr(x, "ATE_EVENT", "") == "dra-api-error"])
            print(
                f"{status} after the return: slice published {published * 1000:.0f} ms, prepare answered "
                f"{took * 1000:.0f} ms after the refusals stopped (publisher's retries {retries} s)"
            )
            assert response.claims[claim].error == ""
            assert [d.device_name for d in response.claims[claim].devices] == ["kvm-0"]
            # Generous for a loaded machine: retries are at most 1 s apart for the publisher, 0.5 s for a
            # prepare; the back-off the outage built up was 30 s.
            assert published < 3.0, published
            assert took < 3.0, took
            assert retries and all(d <= reconnect.RECONNECT_SECONDS for d in retries), retries
            assert not r.log.events("dra-credentials-refused") and not r.log.events("dra-api-refused")
            assert r.driver.metrics.prepare_errors == dict.fromkeys(r.driver.metrics.prepare_errors, 0)

    @pytest.mark.parametrize("status", ["403", "401"])
    async def test_refusals_that_outlast_the_moment_back_off(
        self, status: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Refusals that go on past the moment after the return are real: one warning says so, and the
        long back-off applies again."""
        monkeypatch.setattr(reconnect, "SETTLE_SECONDS", 1.5)
        async with rig(credentials="service-account", backoff=DAEMON_BACKOFF) as r:
            await r.published()
            await outage(r, 5)
            setattr(r.api, STARTING[status], False)
            await r.api.start()
            event = "dra-api-refused" if status == "403" else "dra-credentials-refused"
            (said,) = await r.log.wait_events(event, 1, timeout=10)
            print(f"{status}: {said.getMessage()}")
            assert said.levelno == logging.WARNING
            assert delays([said])[0] >= 2.0  # the outage's back-off (nominally 8 s or more, at least 2 s here)
            if status == "401":
                status_now = await r.status(lambda s: s.slices is SliceState.CREDENTIALS_REFUSED)
                assert "write a new one" in status_now.detail
                assert r.driver.metrics.refused


class TestPrepare:
    async def test_prepare_reads_the_claim_while_the_publisher_backs_off(self) -> None:
        """A prepare asks the API server itself: with the publisher in a 30 s back-off (its connection
        refused), a prepare still reads its claim and succeeds."""
        async with rig(credentials="service-account", backoff=(30.0, 30.0)) as r:
            await r.kubelet.next_event("registered")
            await r.published()
            claim = r.api.add_claim("ns", "vm", [{"request": "kvm", "driver": DRIVER, "pool": POOL, "device": "kvm-1"}])
            r.api.end_watches()  # the connection ends and the next one is refused: the publisher backs off 30 s
            r.api.authorizers_ready = False
            await r.status(lambda s: s.slices is SliceState.API_ERROR)
            r.api.authorizers_ready = True
            response = await r.kubelet.prepare(DRIVER, ("ns", claim, "vm"))
            assert response.claims[claim].error == ""
            assert r.driver.status().slices is SliceState.API_ERROR  # still backing off


class TestRenewedToken:
    @pytest.mark.parametrize("how", ["renamed", "in place"])
    async def test_new_token_file_used_without_a_restart(self, how: str) -> None:
        """The Node is created again: its slice is garbage-collected and the token bound to it refused
        (401). STATUS, one warning and the metric say so; a new token written to the file is used at
        once, whatever the back-off (it had grown to 4 s or more), and the slice is published again."""
        async with rig(credentials="service-account", backoff=DAEMON_BACKOFF) as r:
            assert r.token_file is not None
            await r.published()
            r.api.recreate_node()
            await r.api.next_change("DELETED")
            status = await r.status(lambda s: s.slices is SliceState.CREDENTIALS_REFUSED, timeout=10)
            assert "401 Unauthorized" in status.detail and "write a new one" in status.detail
            assert "the API server refuses the credentials" in str(status)
            assert r.driver.metrics.refused
            await node_lookups(r, 3)  # refused connections 0.5, 1 and 2 s apart: the next waits 4 s
            (said,) = r.log.events("dra-credentials-refused")
            assert said.levelno == logging.WARNING and str(r.config.kubeconfig) in said.getMessage()
            loop = asyncio.get_running_loop()
            written = loop.time()
            write_token(Path(r.token_file), r.api.mint_token(), in_place=how == "in place")
            _, obj = await r.api.next_change("ADDED", timeout=10)
            took = loop.time() - written
            print(f"new token ({how}) -> slice published again: {took * 1000:.0f} ms")
            assert obj["metadata"]["ownerReferences"][0]["uid"] == r.api.nodes["node-1"]["metadata"]["uid"]
            # Generous for a loaded machine; the publisher's next retry was 4 s or more away.
            assert took < 2.0, took
            await r.published()
            assert not r.driver.metrics.refused
            assert r.log.events("dra-credentials-changed")
            assert len(r.log.events("dra-credentials-refused")) == 1

    async def test_prepare_uses_the_new_token(self) -> None:
        """A prepare reads its claim with the token the file holds now."""
        async with rig(credentials="service-account", backoff=DAEMON_BACKOFF) as r:
            assert r.token_file is not None
            await r.kubelet.next_event("registered")
            await r.published()
            claim = r.api.add_claim("ns", "vm", [{"request": "kvm", "driver": DRIVER, "pool": POOL, "device": "kvm-2"}])
            old = next(iter(r.api.bound_tokens))
            new = r.api.mint_token()
            write_token(Path(r.token_file), new)
            await r.log.wait_events("dra-credentials-changed", 1)
            r.api.expire_token(old)
            response = await r.kubelet.prepare(DRIVER, ("ns", claim, "vm"))
            assert response.claims[claim].error == ""
            assert r.api.unauthorized_answers == 0


class TestDoctor:
    async def test_refused_token_is_a_fail_with_the_remedy(self, tmp_path: Path) -> None:
        """``doctor`` with a token the API server refuses (its Node created again): one FAIL saying why,
        with the command that mints a new one."""
        api = FakeApiServer(NODE)
        await api.start()
        try:
            token = tmp_path / "token"
            write_token(token, api.mint_token())
            kc = write_kubeconfig(tmp_path / "kubeconfig", api.url, token_file=str(token))
            dra = DraConfig(node_name=NODE, kubeconfig=str(kc))
            config = dataclasses.replace(kvm_config(tmp_path, tmp_path), mode="dra", dra=dra)
            api.recreate_node()
            (finding,) = await doctor.findings(config, dra, 2.0)
            assert (finding.check, finding.level) == ("apiserver", Level.FAIL)
            assert "does not accept the token" in finding.message and "401" in finding.message
            assert "kubectl create token ate-devplugd -n ate-devplugd --bound-object-kind Node" in finding.remedy
            assert f"--bound-object-name {NODE}" in finding.remedy
        finally:
            await api.stop()
