"""What the edge tells a client a session is doing (GET /v1/sessions/{id},
GetSession, the CLI): the runner's states, and two only the edge can tell.

`parked`: the session stopped after a failure and waits for a person.
`awaiting_approval`: nothing runs and a tool call waits for a person's
decision (inputs sent meanwhile stay owed: the model is asked again once the
call has its result). The edge works these out from the session's facts; the
other three come from the runner that holds the session (`idle` when none).
"""

from __future__ import annotations

from typing import Final, Literal, TypeAlias

from services.runner.events import COMPACTING, IDLE, RUNNING, SessionState

PARKED: Final = "parked"
AWAITING_APPROVAL: Final = "awaiting_approval"
SessionStatus: TypeAlias = Literal[SessionState, "parked", "awaiting_approval"]
# Every status, in the order the API's schema lists them.
SESSION_STATUSES: Final[tuple[SessionStatus, ...]] = (
    IDLE,
    RUNNING,
    COMPACTING,
    PARKED,
    AWAITING_APPROVAL,
)
