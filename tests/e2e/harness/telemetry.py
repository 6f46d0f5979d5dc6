"""Reading the app's telemetry from outside, as an operator's tools do.

:class:`OTLPCollector` is a minimal OTLP/HTTP trace receiver (what an
OpenTelemetry Collector listens with on port 4318): the replicas export their
spans to it over the network and it keeps them in memory for the tests.
:func:`scrape` reads Ray's Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tests.e2e.harness.ray_cluster import METRICS_REPORT_S
from tests.waiting import wait_until


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


class OTLPCollector:
    """Receives ``POST /v1/traces`` (OTLP protobuf) on 127.0.0.1 and keeps every span."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector._receive(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _receive(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# How often a test waiting on a metric reads Ray's endpoint: Ray exports every METRICS_REPORT_S, and
# the suite's page is some 3 MB (8,000 samples; 1.8 s to fetch on the busy machine).
SCRAPE_EVERY_S = 1.0


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text endpoint, keyed by name and labels."""
    return parse_samples(httpx.get(url, timeout=10).text)


# A sample line of Prometheus's text format (name, labels, value, optional timestamp) and one label.
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r"\\(.)")


def parse_samples(text: str) -> Samples:
    """The samples of a Prometheus text page, as prometheus_client's parser reads them, in regular
    expressions: its parser takes about 150 us a sample, and the suite's page holds thousands (every
    replica's histograms), read every few seconds while a test waits on a metric."""
    samples: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = match.groups()
        samples[name, _labels(labels or "")] = float(value)
    return samples


@functools.lru_cache(maxsize=1 << 17)
def _labels(text: str) -> frozenset[tuple[str, str]]:
    """The labels of one sample line (kept: the same series come back in every scrape)."""
    return frozenset((k, _ESCAPED.sub(_unescape, v) if "\\" in v else v) for k, v in _LABEL.findall(text))


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match.group(1) == "n" else match.group(1)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (over replicas, buckets ...)."""
    wanted = set(labels.items())
    return sum(value for (sample, have), value in samples.items() if sample == name and wanted <= have)


def increase(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much ``name`` (over the series whose labels include ``labels``) grew between two
    scrapes, series by series: a series that appeared counts from 0, one that vanished (its
    replica stopped) takes nothing away."""
    wanted = set(labels.items())
    return sum(
        value - before.get((sample, have), 0.0)
        for (sample, have), value in after.items()
        if sample == name and wanted <= have
    )


async def settled(url: str, name: str, within_s: float = 60.0) -> Samples:
    """A scrape after which ``name`` held still for a whole report interval of the suite's cluster.

    Earlier tests' traffic is then in it, not reported late into a test's own
    measurement. The wait is the condition itself: two scrapes an interval apart that agree.
    """
    previous: Samples | None = None

    async def still() -> Samples | None:
        nonlocal previous
        samples = await asyncio.to_thread(scrape, url)
        steady = previous is not None and total(samples, name) == total(previous, name)
        previous = samples
        return samples if steady else None

    return await wait_until(still, within_s, f"{name} holding still", every_s=METRICS_REPORT_S + 0.5)
