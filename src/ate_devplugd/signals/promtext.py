"""The Prometheus text exposition format (version 0.0.4), as node_exporter's textfile collector reads it.

A metric family is a ``Family``: its name, ``MetricType``, help, label names and samples; ``exposition``
renders families, each with its HELP and TYPE lines and one line per sample, help text and label
values escaped as the format says. Gauges, counters (``_total`` on every line, without a ``_created``
series) and histograms without labels are all a textfile writer needs.

prometheus_client is not used: of it a textfile writer needs only the rendering of gauges and counters,
while importing its package (with an HTTP server, WSGI, URL and e-mail code, process and platform
collectors) costs 3.6 MiB of RSS, more than a third of what the daemon adds to the libraries it needs.
The tests read the rendered text with prometheus_client's own parser beside its own rendering of the
same families, with promtool and through a real node_exporter scrape.

Nothing here knows what is counted: the daemon's series are ``signals/metrics.py``'s, DRA mode's
``dra/metrics.py``'s.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field


class MetricType(enum.Enum):
    """A family's TYPE in the text format, and the suffix of its plain samples' names."""

    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


#: One sample: its name's suffix (``_total``, ``_bucket``, ...), its labels in order, its value.
Sample = tuple[str, tuple[tuple[str, str], ...], float]


@dataclass
class Family:
    """One metric family: its name (a counter's without ``_total``), help, label names and samples."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def gauge(cls, name: str, help_text: str, *labels: str) -> Family:
        return cls(name, MetricType.GAUGE, help_text, labels)

    @classmethod
    def counter(cls, name: str, help_text: str, *labels: str) -> Family:
        return cls(name, MetricType.COUNTER, help_text, labels)

    @classmethod
    def histogram(cls, name: str, help_text: str, buckets: Iterable[tuple[float, int]], total: float) -> Family:
        """A histogram without labels: ``buckets`` are (upper bound, observations up to it) with the last
        bound +Inf (its count is ``_count``), ``total`` the sum of the observations."""
        family = cls(name, MetricType.HISTOGRAM, help_text)
        count = 0
        for bound, count in buckets:
            family.samples.append(("_bucket", (("le", _value(float(bound))),), count))
        if not family.samples or family.samples[-1][1] != (("le", "+Inf"),):
            raise ValueError(f"{name}: the last bucket must be +Inf")
        family.samples += [("_count", (), count), ("_sum", (), total)]
        return family

    def add_metric(self, label_values: Iterable[str], value: float) -> None:
        """One sample of a gauge or counter: a value for each label name, in order."""
        values = tuple(label_values)
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.labels)} label values expected, got {values!r}")
        suffix = "_total" if self.type is MetricType.COUNTER else ""
        self.samples.append((suffix, tuple(zip(self.labels, values, strict=True)), value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(value: float) -> str:
    """A sample value: whole numbers (booleans, counts) exactly, any other float as Python writes it."""
    if isinstance(value, bool | int):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def exposition(families: Iterable[Family]) -> bytes:
    """The text format 0.0.4: per family its HELP and TYPE lines, then one line per sample.

    A counter's name takes ``_total`` on every line, as OpenMetrics names counters (and promtool's
    lint asks); a histogram's samples are its ``_bucket`` lines, ``_count`` and ``_sum``. Labels go in
    name order (as prometheus_client wrote them). Help text and label values are escaped as the format
    says (backslash, newline and, in label values, the double quote).
    """
    lines: list[str] = []
    for family in families:
        name = family.name + "_total" if family.type is MetricType.COUNTER else family.name
        lines.append(f"# HELP {name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {name} {family.type.value}")
        for suffix, labels, value in family.samples:
            pairs = ",".join(f'{label}="{_escape_label(v)}"' for label, v in sorted(labels))
            sample = family.name + suffix
            lines.append(f"{sample}{{{pairs}}} {_value(value)}" if pairs else f"{sample} {_value(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""
