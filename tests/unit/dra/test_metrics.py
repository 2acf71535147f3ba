"""DRA mode's own series, and the shared counters its events feed (in process, no I/O)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ate_devplugd.config.dra import Layout
from ate_devplugd.dra.apiclient import ApiErrorKind
from ate_devplugd.dra.metrics import PREPARE_BUCKETS, ClaimProblem, DraMetrics
from ate_devplugd.dra.slice_plan import PublishReason
from ate_devplugd.signals.metrics import Metrics

KVM = "ate.dev/kvm"
VHOST = "ate.dev/vhost-net"


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def rendered(resources: tuple[str, ...] = (KVM, VHOST)) -> tuple[Metrics, DraMetrics]:
    shared = Metrics()
    for resource in resources:
        shared.add_resource(resource)
    dra = DraMetrics("kvm.ate.dev", Layout.UNITS, resources, shared=shared)
    shared.add_source(dra)
    return shared, dra


class TestDraMetrics:
    def test_every_series_from_the_start(self) -> None:
        """DRA's series are there at 0 for every label value they can take, beside the daemon's own."""
        shared, _ = rendered()
        got = samples(shared)
        assert got[("ate_devplugd_dra_info", (("driver", "kvm.ate.dev"), ("sharing", "units")))] == 1
        assert got[("ate_devplugd_dra_prepares_total", ())] == 0
        assert got[("ate_devplugd_dra_unprepares_total", ())] == 0
        for problem in ClaimProblem:
            assert got[("ate_devplugd_dra_prepare_errors_total", (("reason", problem.value),))] == 0
        for kind in ApiErrorKind:
            assert got[("ate_devplugd_dra_api_errors_total", (("reason", kind.value),))] == 0
        for resource in (KVM, VHOST):
            for reason in PublishReason:
                key = (("reason", reason.value), ("resource", resource))
                assert got[("ate_devplugd_dra_slice_publishes_total", key)] == 0
        assert got[("ate_devplugd_dra_prepare_duration_seconds_count", ())] == 0
        assert got[("ate_devplugd_dra_credentials_refused", ())] == 0
        assert ("ate_devplugd_registered", (("resource", KVM),)) in got  # the daemon's own are still there

    def test_a_prepared_claim_is_one_allocation_of_each_resource_it_got(self) -> None:
        """Two devices of one resource in one claim are one allocation of it; claims are counted apart."""
        shared, dra = rendered()
        dra.claim_prepared([KVM, KVM])
        dra.claim_prepared([KVM, VHOST])
        dra.claim_prepared([])  # a claim with no device of this driver
        got = samples(shared)
        assert got[("ate_devplugd_allocations_total", (("resource", KVM),))] == 2
        assert got[("ate_devplugd_allocations_total", (("resource", VHOST),))] == 1
        assert got[("ate_devplugd_dra_prepares_total", ())] == 3

    def test_registration_notices(self) -> None:
        """kubelet's notices count as registrations (or failed ones) of every resource."""
        shared, dra = rendered()
        dra.registration(True)
        dra.registration(True)
        dra.registration(False)
        got = samples(shared)
        for resource in (KVM, VHOST):
            assert got[("ate_devplugd_registrations_total", (("resource", resource),))] == 2
            assert got[("ate_devplugd_register_failures_total", (("resource", resource),))] == 1

    @pytest.mark.parametrize("seconds", [0.0, 0.004, 0.03, 0.05, 1.0, 44.0, 100.0])
    def test_prepare_latency_buckets(self, seconds: float) -> None:
        """A call lands in every bucket whose bound it does not exceed (cumulative), and in the sum."""
        shared, dra = rendered()
        dra.prepare_call(seconds)
        got = samples(shared)
        for bound in PREPARE_BUCKETS:
            key = ("ate_devplugd_dra_prepare_duration_seconds_bucket", (("le", repr(bound)),))
            assert got[key] == (1 if seconds <= bound else 0), bound
        assert got[("ate_devplugd_dra_prepare_duration_seconds_bucket", (("le", "+Inf"),))] == 1
        assert got[("ate_devplugd_dra_prepare_duration_seconds_sum", ())] == pytest.approx(seconds)

    def test_each_event_is_a_change(self) -> None:
        """The file is written after DRA's events as after the daemon's (one on_change each)."""
        calls: list[None] = []
        shared, dra = rendered()
        shared.on_change = lambda prompt: calls.append(None)
        dra.claim_failed(ClaimProblem.NOT_FOUND)
        dra.claims_unprepared(2)
        dra.claims_unprepared(0)  # nothing changed
        dra.slice_written(KVM, PublishReason.REPUBLISHED)
        dra.api_error(ApiErrorKind.FORBIDDEN)
        dra.prepare_call(0.01)
        assert len(calls) == 5
        got = samples(shared)
        assert got[("ate_devplugd_dra_unprepares_total", ())] == 2
        assert got[("ate_devplugd_dra_api_errors_total", (("reason", "forbidden"),))] == 1

    def test_credentials_refused_is_state(self) -> None:
        """The gauge follows the state: 1 while refused, 0 again after; saying it twice is no change."""
        calls: list[None] = []
        shared, dra = rendered()
        shared.on_change = lambda prompt: calls.append(None)
        dra.credentials_refused(True)
        dra.credentials_refused(True)
        assert samples(shared)[("ate_devplugd_dra_credentials_refused", ())] == 1
        dra.credentials_refused(False)
        assert samples(shared)[("ate_devplugd_dra_credentials_refused", ())] == 0
        assert len(calls) == 2

    @pytest.mark.parametrize(
        ("status", "kind"),
        [
            (401, "unauthorized"),
            (403, "forbidden"),
            (404, "not_found"),
            (409, "conflict"),
            (410, "other"),
            (422, "invalid"),
            (429, "throttled"),
            (500, "server_error"),
            (503, "server_error"),
            (400, "other"),
        ],
    )
    def test_api_error_kinds(self, status: int, kind: str) -> None:
        assert ApiErrorKind.of_status(status).value == kind
