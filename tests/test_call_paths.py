"""One client call path: errors are mapped in one place, messages by one codec.

A typed client that caught `AioRpcError` itself would be a second place
where status codes turn into exceptions, free to drift from the first; a
servicer and a client each spelling a message's fields would drift the same
way. These tests pin both.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from services.ledger.codec import fact_from_pb, fact_to_pb, view_from_pb, view_to_pb
from services.ledger.domain import OpenToolCall, SessionView
from services.ledger.facts import CommittedFact
from services.runner.codec import watch_event_from_pb, watch_event_to_pb
from services.runner.hub import Partial, ReplayEnd, StatusChange

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernel", "compaction", "edge", "services", "keel_client")
# The one module where a failed call becomes an exception (errors.py holds
# the status <-> exception functions it uses), and the public client
# library's own error mapping.
ALLOWED = {
    Path("services/common/rpc.py"),
    Path("services/common/errors.py"),
}


def test_only_the_call_path_module_catches_rpc_errors() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative in ALLOWED or relative.parts[0] == "keel_client":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "AioRpcError":
                    offenders.append(f"{relative}:{node.lineno}")
    assert offenders == [], "map errors through services.common.rpc, not here"


ints = st.integers(min_value=0, max_value=(1 << 63) - 1)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789:-_", min_size=1, max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 53), 1 << 53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@given(
    st.builds(
        CommittedFact,
        session_id=ids,
        seq=ints,
        kind=ids,
        data=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
        timestamp_ms=ints,
        epoch=ints,
    )
)
def test_a_fact_survives_its_codec(fact: CommittedFact) -> None:
    assert fact_from_pb(fact_to_pb(fact)) == fact


@given(
    st.builds(
        SessionView,
        session_id=ids,
        tenant_id=ids,
        head_seq=ints,
        fence_epoch=ints,
        owed_input_seqs=st.lists(ints, max_size=4).map(tuple),
        open_tool_calls=st.lists(st.builds(OpenToolCall, ids, ids, ints), max_size=3).map(tuple),
        latest_compaction_seq=ints,
        read_watermark=ints,
        parked=st.booleans(),
        latest_cancel_seq=ints,
        context_head_seq=ints,
    )
)
def test_a_session_view_survives_its_codec(view: SessionView) -> None:
    assert view_from_pb(view_to_pb(view)) == view


@given(
    st.one_of(
        st.builds(
            Partial,
            generation_id=ids,
            channel=st.sampled_from(["text", "thinking", "tool_call"]),
            text=st.text(max_size=20),
            epoch=ints,
            attempt_id=ids,
            tool_call_id=st.text(max_size=10),
            tool_name=st.text(max_size=10),
        ),
        st.builds(StatusChange, st.sampled_from(["idle", "running", "compacting"]), epoch=ints),
        st.builds(ReplayEnd, st.integers(0, 1 << 30)),
    )
)
def test_a_watch_event_survives_its_codec(event: Partial | StatusChange | ReplayEnd) -> None:
    assert watch_event_from_pb(watch_event_to_pb(event)) == event
