"""OpenTelemetry traces: one span per request at the front door, a child span in the engine.

Tracing is off unless the standard OTLP environment variables name a collector
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keep it off. The
exporter itself reads the rest of ``OTEL_EXPORTER_OTLP_*`` (protocol, headers,
timeouts) and the resource reads ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, as every OpenTelemetry SDK does.

The front door continues the client's W3C ``traceparent``; the trace context
travels to the replica as a small dict argument of the handle call (a Ray actor
call has no headers). When tracing is off, spans are OpenTelemetry's no-op spans.

Runs in each model replica: the front door opens a request's span, the engine its child.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

logger = logging.getLogger("ray.serve")

TRACER_NAME = "glm4_serve"
DEFAULT_SERVICE_NAME = "glm4-serve"
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_requested(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return any(environ.get(name) for name in _ENDPOINT_VARIABLES)


def otlp_protocol(environ: Mapping[str, str]) -> str:
    """The OTLP transport named by the environment; the specification's default is HTTP."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (protocol or "http/protobuf").strip().lower()


def configure_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Install an OTLP-exporting tracer provider in this process if the environment asks; say whether it did.

    Called once by each replica as it starts; a process that already has a
    provider keeps it (OpenTelemetry allows one per process).
    """
    environ = os.environ if environ is None else environ
    if not tracing_requested(environ):
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = otlp_protocol(environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
    else:
        logger.warning("OTLP protocol %r is not supported (grpc, http/protobuf); traces are off", protocol)
        return False
    # vLLM's engine processes, started after this, export their own spans when they see
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, and default to gRPC: make them speak the same protocol.
    if environ is os.environ:
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


@functools.cache
def tracer() -> trace.Tracer:
    """This process's tracer, got once (a provider set later is still used: OpenTelemetry's proxy
    tracer forwards to it), not per request."""
    return trace.get_tracer(TRACER_NAME)


def start_request_span(name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> Span:
    """The front door's span of one request, a child of the client's ``traceparent`` if it sent one."""
    return tracer().start_span(name, context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes)


def trace_context(span: Span) -> dict[str, str]:
    """What the replica needs to continue ``span``'s trace: W3C ``traceparent`` (and ``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_engine_span(name: str, context: Mapping[str, str] | None, attributes: dict[str, Any]) -> Span:
    """The engine's span of one generation, a child of the front door's span that ``context`` carries.

    ``INTERNAL``: the front door that called it runs in the same process, or (when another
    replica answers in its place) calls it through Serve's handle, a span of its own already.
    """
    return tracer().start_span(
        name, context=propagate.extract(context or {}), kind=SpanKind.INTERNAL, attributes=attributes
    )
