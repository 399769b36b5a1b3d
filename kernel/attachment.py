"""A runtime's Attach stream to the kernel, held open in the background.

The stream is how the kernel knows a runtime is alive: when the process dies
its socket closes, the stream breaks and the kernel expires the runtime's
leases at once (fast takeover, kernel/expiry.py). Apart from the client's
calls (kernel/client.py) because it is a task of its own with its own
reconnection policy, not a request and its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.errors import InvalidArgument, KernelError, UnknownRuntime
from services.common.errors import KeelError
from services.common.rpc import streaming

# Re-attach delays after a broken stream: quick at first, then at most 2 s.
REATTACH_FIRST_S = 0.05
REATTACH_MAX_S = 2.0


class Attachment:
    """Holds a runtime's Attach stream open in a background task.

    While it is open the kernel knows the runtime is alive; when the process
    dies the stream breaks and the kernel expires the runtime's leases at
    once (fast takeover). A stream broken while the process lives (a kernel
    restart, a network blip) is re-opened with a short backoff.
    """

    def __init__(
        self,
        stub: pb_grpc.KernelServiceAsyncStub,
        runtime_id: str,
        reregister: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.runtime_id = runtime_id
        self._stub = stub
        # The kernel forgets runtimes detached for long (KEEL_RUNTIME_RETENTION_MS):
        # one that comes back after that registers again instead of giving up.
        self._reregister = reregister
        self._connected = asyncio.Event()
        self._closed = False
        # A permanent refusal (unknown runtime, bad id) that ended the task.
        self.error: KeelError | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._hold(), name=f"kernel-attach-{runtime_id}"
        )

    @property
    def closed(self) -> bool:
        return self._closed or self._task.done()

    @property
    def connected(self) -> bool:
        """The stream is open and the kernel has answered on it."""
        return self._connected.is_set()

    async def wait_connected(self) -> None:
        """Returns once the kernel confirmed the stream; raises if refused."""
        connected = asyncio.ensure_future(self._connected.wait())
        try:
            await asyncio.wait({connected, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            connected.cancel()
        if not self._connected.is_set():
            raise self.error or KernelError(f"the attachment of {self.runtime_id!r} ended")

    async def _hold(self) -> None:
        delay = REATTACH_FIRST_S
        while True:
            call = self._stub.Attach(pb.AttachRequest(runtime_id=self.runtime_id))
            try:
                async for _ in streaming(call, KernelError):
                    self._connected.set()
                    delay = REATTACH_FIRST_S
            except KeelError as error:
                if isinstance(error, UnknownRuntime) and self._reregister is not None:
                    with contextlib.suppress(KeelError):
                        await self._reregister()
                elif isinstance(error, UnknownRuntime | InvalidArgument):
                    self.error = error
                    return
            finally:
                self._connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, REATTACH_MAX_S)

    async def close(self) -> None:
        """Ends the stream (the kernel then expires whatever is still held)."""
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def __aenter__(self) -> Attachment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
