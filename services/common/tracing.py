"""One trace per turn: the span helpers every service uses.

A turn's trace starts at the input's request (the edge's HTTP or gRPC server
span). Its context is kept in the input fact itself, as a W3C `traceparent`
field of the fact's data: the attempt that answers — in whichever runner
process, after however many crashes — reads it from the ledger with the
input and continues that trace. The edge strips the field from every fact it
serves (`client_data`), so clients never see it.

Why a data field rather than fact metadata of its own: the input fact
already travels to every reader (the ledger's reads and subscriptions, the
runner's fact cache) and its request-id dedup fingerprint ignores unknown
fields, so nothing in the ledger's schema, wire format or storage changes,
and a resent input keeps the trace of its first commit.

An answer may consume several inputs (those committed while an earlier
attempt ran are answered together). The attempt continues the first one's
trace and links to the others'; the span of the answer's commit
(`keel.answer`) links to every input it answered; and each other input's
trace gets a `keel.answered` span linking back to it, so that no input's
trace ends at its enqueue.

With `KEEL_OTEL_EXPORTER=none` tracing is off: `span` hands back one shared
no-op context manager and nothing is stored with inputs, so the hot paths pay
a flag test per call and nothing more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext

# The key of the input fact's data that holds the turn's trace context.
TRACEPARENT: Final = "traceparent"

# Attribute names the spans of a turn carry.
SESSION_ID: Final = "keel.session_id"
TENANT_ID: Final = "keel.tenant_id"
EPOCH: Final = "keel.epoch"
ATTEMPT_ID: Final = "keel.attempt_id"

# The request fields that name a session and a tenant in Keel's protos.
_SESSION_FIELD: Final = "session_id"
_TENANT_FIELD: Final = "tenant_id"

_enabled = False
_NO_SPAN: Final = contextlib.nullcontext(trace.INVALID_SPAN)


def enable(on: bool) -> None:
    """Turns the span helpers on (telemetry.configure, once an exporter takes spans)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def _tracer() -> trace.Tracer:
    return trace.get_tracer("keel")


def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    context: otel_context.Context | None = None,
    links: Sequence[Link] = (),
    start_time: int | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """A span made current for its block, with `attributes` and `extra`
    (two maps, so callers pass a shared map without merging it when tracing
    is off); a shared no-op when tracing is off."""
    if not _enabled:
        return _NO_SPAN
    merged = {**(attributes or {}), **(extra or {})}
    return _tracer().start_as_current_span(
        name, context=context, attributes=merged, links=links, start_time=start_time
    )


def set_attributes(span_: Span, attributes: Mapping[str, Any]) -> None:
    """Adds attributes to a span once known (e.g. tokens after a call)."""
    if _enabled and span_.is_recording():
        span_.set_attributes(dict(attributes))


def annotate_current(attributes: Mapping[str, Any]) -> None:
    """Adds attributes to the current span (e.g. a server span made by an
    instrumentation, once the handler knows the session)."""
    if _enabled:
        set_attributes(trace.get_current_span(), attributes)


def request_attributes(span_: Span, request: Any) -> None:
    """The gRPC client instrumentation's request hook: a call naming a
    session (and tenant) says so on its span."""
    attributes: dict[str, str] = {}
    for field, attribute in ((_SESSION_FIELD, SESSION_ID), (_TENANT_FIELD, TENANT_ID)):
        value = getattr(request, field, None)
        if isinstance(value, str) and value:
            attributes[attribute] = value
    if attributes and span_.is_recording():
        span_.set_attributes(attributes)


def current_traceparent() -> str | None:
    """The current span's context as a W3C traceparent, None when there is
    none worth keeping (tracing off, or no span started)."""
    if not _enabled or not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get(TRACEPARENT)


def context_of(traceparent: Any) -> otel_context.Context | None:
    """The context a stored traceparent names (None for none or a bad one)."""
    if not isinstance(traceparent, str):
        return None
    found = extract({TRACEPARENT: traceparent})
    if not trace.get_current_span(found).get_span_context().is_valid:
        return None
    return found


def _span_contexts(traceparents: Sequence[Any]) -> list[SpanContext]:
    """The span contexts the traceparents name, each once, in order."""
    found: list[SpanContext] = []
    for traceparent in traceparents:
        context = context_of(traceparent)
        if context is None:
            continue
        span_context = trace.get_current_span(context).get_span_context()
        if span_context not in found:
            found.append(span_context)
    return found


@contextlib.contextmanager
def answer_span(
    attributes: Mapping[str, Any], extra: Mapping[str, Any], traceparents: Sequence[Any]
) -> Iterator[Span]:
    """`keel.answer`, the span of an answer's commit, linked to the trace of
    every input it answers; once it ends, each of those traces other than
    its own gets a `keel.answered` span linked back to it."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    answered = _span_contexts(traceparents)
    merged = {**attributes, **extra}
    links = [Link(context) for context in answered]
    with _tracer().start_as_current_span("keel.answer", attributes=merged, links=links) as answer:
        yield answer
    own = answer.get_span_context()
    for context in answered:
        if context.trace_id == own.trace_id:
            continue
        parent = trace.set_span_in_context(NonRecordingSpan(context))
        _tracer().start_span(
            "keel.answered", context=parent, attributes=merged, links=[Link(own)]
        ).end()


def turn_parent(traceparents: Sequence[Any]) -> tuple[otel_context.Context, list[Link]]:
    """Where an attempt answering several inputs hangs: under the first
    input's context, with links to the others'; a root of its own when no
    input has one (stored while tracing was off)."""
    contexts = [c for c in (context_of(t) for t in traceparents) if c is not None]
    if not contexts:
        return otel_context.Context(), []
    links = [Link(trace.get_current_span(c).get_span_context()) for c in contexts[1:]]
    return contexts[0], links


def client_data(kind: str, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A fact's data as clients see it: without the input's trace context."""
    if kind != "input" or TRACEPARENT not in data:
        return data
    return {k: v for k, v in data.items() if k != TRACEPARENT}


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Runs a block outside any trace (a background task started from inside a
    turn's span must not make all its work that turn's children)."""
    if not _enabled:
        yield
        return
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)
