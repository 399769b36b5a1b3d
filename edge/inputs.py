"""Inputs: committed to the ledger first (idempotent by requestId), then
the kernel is woken; retries and cancels, the same operations for the HTTP
routes and the gRPC API.

A requestId comes from the body, or the `Idempotency-Key` header, or is
made here; a made one is not retry-safe (the client has nothing to send
again), and the answer says so.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge import bodies
from edge.auth import Caller
from edge.bodies import InputBody, RetryBody
from edge.errors import BadRequest, Busy, NotParked, Unavailable, shown
from edge.gateway import Gateway
from edge.multitask import ENQUEUE, REJECT, ROLLBACK
from services.blobs import is_blob_id
from services.common import tracing
from services.common.errors import KeelError
from services.ledger import Appended, FactToAppend
from services.ledger.errors import InvalidFact, SessionBusy
from services.ledger.facts import CANCELLED, INPUT, INPUTS_SKIPPED, Multitask
from services.ledger.packed_facts import pack_input

log = logging.getLogger(__name__)

# What the ledger accepts as a requestId, checked here first so that a refusal
# quotes no more of a client's value than `shown` allows.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")


class InvalidBlobId(BadRequest):
    """An input names something that is not a blob id."""

    reason = "INVALID_BLOB_ID"


@dataclass(frozen=True)
class Committed:
    """An input in the ledger, as the client is told of it."""

    seq: int
    # The requestId had committed this input already (the answer is 200).
    duplicate: bool
    request_id: str
    # False when the edge made the requestId: the client has no id to send
    # again, so resending the request would commit a second input.
    retry_safe: bool

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "requestId": self.request_id, "retrySafe": self.retry_safe}


def _request_id(given: str | None, idempotency_key: str | None) -> tuple[str, bool]:
    """The input's requestId (body or Idempotency-Key header, else a new one)
    and whether the client chose it."""
    if given is not None and idempotency_key is not None and given != idempotency_key:
        raise BadRequest(
            "requestId and the Idempotency-Key header differ; send one of them", field="requestId"
        )
    chosen = given if given is not None else idempotency_key
    if chosen is None:
        return f"edge-{uuid.uuid4().hex}", False
    if not _REQUEST_ID.fullmatch(chosen):
        raise BadRequest(
            "a requestId (or Idempotency-Key) is 1-128 characters of letters, digits, "
            f"'_.:-', got {shown(chosen)}",
            field="requestId",
        )
    return chosen, True


async def commit_input(
    gateway: Gateway,
    caller: Caller,
    session_id: str,
    body: InputBody | Mapping[str, Any],
    idempotency_key: str | None = None,
) -> Committed:
    """Commits an input (`text`, `requestId`?, `blobs`?) then wakes the kernel."""
    body = bodies.convert(body, InputBody)
    await gateway.check_owner(caller, session_id)
    request_id, retry_safe = _request_id(body.request_id, idempotency_key)
    data: dict[str, Any] = {"text": body.text, "requestId": request_id}
    if body.blobs is not None:
        data["blobs"] = await _complete_blobs(gateway, caller, body.blobs)
    mode = body.multitask or await gateway.multitask_defaults.of(caller.tenant_id)
    if mode != ENQUEUE:
        data["multitask"] = mode
    # A parked session stays parked: the input is owed, and it is not
    # batched with the inputs the session failed on (a skip, a retry or a
    # cancel is the way on).
    return await _append_input(
        gateway, caller, session_id, data, retry_safe, unpark=False, mode=mode
    )


async def _complete_blobs(gateway: Gateway, caller: Caller, blobs: list[str]) -> list[str]:
    """The blob ids an input references, each the id of a complete blob of
    the caller's, found through the store. An id is never a path: one that
    does not have the store's shape (`../../x`, a trailing newline) is
    refused here before anything is looked up."""
    for blob_id in blobs:
        if not is_blob_id(blob_id):
            raise InvalidBlobId(
                f"{shown(blob_id)} is not a blob id (POST /v1/blobs makes them)", field="blobs"
            )
    for blob_id in blobs:
        info = await asyncio.to_thread(gateway.blobs.get, caller.tenant_id, blob_id)
        if not info.complete:
            raise BadRequest(f"blob {info.id} is not completely uploaded", field="blobs")
    return list(blobs)


async def retry(
    gateway: Gateway,
    caller: Caller,
    session_id: str,
    body: RetryBody | Mapping[str, Any],
    idempotency_key: str | None = None,
) -> Committed:
    """Asks input `seq` again: a new input with its text and blobs, and
    `retryOf`. Deduplicated like any input, so one requestId re-asks once,
    and a requestId used to retry another seq is a conflict."""
    body = bodies.convert(body, RetryBody)
    await gateway.check_owner(caller, session_id)
    seq = body.seq
    request_id, retry_safe = _request_id(body.request_id, idempotency_key)
    facts, _ = await gateway.ledger.read(session_id, seq - 1, 1)
    if not facts or facts[0].seq != seq or facts[0].kind != INPUT:
        raise BadRequest(f"seq {seq} is not an input of this session", field="seq")
    original = facts[0].data
    data: dict[str, Any] = {"text": original["text"], "requestId": request_id, "retryOf": seq}
    if original.get("blobs"):
        data["blobs"] = list(original["blobs"])
    # Asking again is the way out of a park: the session runs again.
    return await _append_input(gateway, caller, session_id, data, retry_safe, unpark=True)


async def _append_input(
    gateway: Gateway,
    caller: Caller,
    session_id: str,
    data: dict[str, Any],
    retry_safe: bool,
    *,
    unpark: bool,
    mode: Multitask = ENQUEUE,
) -> Committed:
    # Everything is validated before this append (the edge's ids are a
    # subset of what the ledger and the kernel accept): once it commits, the
    # answer must say so, never a refusal a client would read as "not sent".
    # The request's span (HTTP or gRPC) names the session it added to.
    tracing.annotate_current({tracing.SESSION_ID: session_id, tracing.TENANT_ID: caller.tenant_id})
    traceparent = tracing.current_traceparent()
    if traceparent is not None:
        # The turn's trace goes on in whichever runner answers this input.
        data[tracing.TRACEPARENT] = traceparent
    request_id = data["requestId"]
    appended = await _commit(gateway, session_id, data, mode)
    # The input as committed, for a runner that keeps the session (it then
    # reads nothing before its turn); a duplicate's committed data may be
    # another request's, so it is read as usual.
    facts = b"" if appended.duplicate else pack_input(session_id, appended.seq, data)
    try:
        # A duplicate still enqueues: the first attempt to wake may be the
        # one that was lost, and a spare wake-up is harmless.
        await gateway.kernel.enqueue(
            session_id, caller.tenant_id, appended.seq, unpark=unpark, facts=facts
        )
    except KeelError as error:
        # Said once per outage, not once per input (services.common.outage_log).
        gateway.wake_ups.failed(
            f"input {appended.seq} of {session_id} committed, not woken: {error}"
        )
        # Committed, but the kernel has not heard of it: sending the same
        # requestId again is a duplicate that wakes it.
        unwoken = Unavailable(
            f"the input is committed as seq {appended.seq} but the session could not be "
            f"woken; send it again with requestId {request_id!r} to wake it",
            reason="INPUT_COMMITTED_NOT_WOKEN",
        )
        unwoken.metadata.update({"seq": str(appended.seq), "requestId": request_id})
        raise unwoken from None
    gateway.wake_ups.succeeded()
    return Committed(appended.seq, appended.duplicate, request_id, retry_safe)


@dataclass(frozen=True)
class Cancelled:
    """A committed cancel: its seq, and the inputs it settles (every input
    owed when it was committed; the runner settles them as cancelled)."""

    seq: int
    input_seqs: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "cancelled": True, "inputSeqs": list(self.input_seqs)}


async def _commit(
    gateway: Gateway, session_id: str, data: dict[str, Any], mode: Multitask
) -> Appended:
    """The input's append, as its strategy asks (edge/multitask.py)."""
    ledger = gateway.ledger
    the_input = FactToAppend(INPUT, data)
    try:
        if mode == REJECT:
            return (await ledger.append(session_id, [the_input], only_if_idle=True))[0]
        if mode == ROLLBACK:
            # One append: the cancel withdraws every input owed before it,
            # never this one, and a retried request commits neither again.
            withdraw = FactToAppend(
                CANCELLED, {"reason": "rollback", "requestId": data["requestId"]}
            )
            return (await ledger.append(session_id, [withdraw, the_input]))[1]
    except SessionBusy:
        raise Busy("the session is busy answering; nothing was committed") from None
    return await ledger.append_one(session_id, INPUT, data)


async def cancel(gateway: Gateway, caller: Caller, session_id: str) -> Cancelled | None:
    """Commits a cancel; None when there is nothing to cancel (no owed input,
    no open tool call, nobody holding the session), so an idle session's
    history gains no empty cancel. A parked session is woken for it: the
    cancel settles what it names instead of waiting behind the park."""
    view = await gateway.session(caller, session_id)
    # The lease is asked directly, not through owner(): an unreachable
    # kernel must be a 503, not a claim that nothing runs.
    if (
        not view.owed_input_seqs
        and not view.open_tool_calls
        and (await gateway.kernel.get_lease(session_id)).lease is None
    ):
        return None
    appended = await gateway.ledger.append_one(session_id, CANCELLED, {"reason": "client"})
    await gateway.kernel.enqueue(session_id, caller.tenant_id, unpark=view.parked)
    return Cancelled(appended.seq, view.owed_input_seqs)


@dataclass(frozen=True)
class Skipped:
    """What a skip settled: its fact's seq and the inputs it names."""

    seq: int
    input_seqs: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "skipped": list(self.input_seqs)}


async def skip(gateway: Gateway, caller: Caller, session_id: str) -> Skipped:
    """Settles the inputs a parked session failed on, and only those, with
    an `inputs_skipped` fact (the model sees a note that says why), then
    wakes the session for the inputs still owed. A session that is not
    parked on named inputs has nothing to skip (NotParked)."""
    view = await gateway.session(caller, session_id)
    if not view.parked or not view.parked_on:
        raise NotParked(
            "the session is not parked on a failed input: there is nothing to skip",
        )
    data = {"inputSeqs": list(view.parked_on), "reason": view.parked_reason}
    try:
        appended = await gateway.ledger.append_one(session_id, INPUTS_SKIPPED, data)
    except InvalidFact:
        # Another skip or cancel settled them first.
        raise NotParked("the inputs the session was parked on are settled already") from None
    latest_input = max(view.owed_input_seqs, default=0)
    await gateway.kernel.enqueue(session_id, caller.tenant_id, latest_input, unpark=True)
    return Skipped(appended.seq, view.parked_on)
