"""The headers every HTTP answer of the edge carries, for browsers.

- `X-Content-Type-Options: nosniff`: a body is what its Content-Type says
  (a JSON answer quoting a client's text is never sniffed into HTML).
- `Content-Security-Policy` with `frame-ancestors 'none'` (and the older
  `X-Frame-Options: DENY`): no other site frames the page to trick a click.
  The web page (`/`, `/static/…`) may load its own modules, styles and
  images from the edge and talk to the edge only; every other answer is
  data, allowed nothing at all.
- `Referrer-Policy: no-referrer`: the page's URL (its `#session=`) never
  leaves with a request.

A route may set its own (a downloaded blob is `sandbox`ed): it keeps it,
and `frame-ancestors 'none'` is added when its policy does not say.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
DATA_POLICY = "default-src 'none'; frame-ancestors 'none'"
COMMON: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
_CSP = b"content-security-policy"


def security_headers(path: str) -> list[tuple[bytes, bytes]]:
    """The headers of an answer to `path`, for answers made outside the app."""
    return [*COMMON, (_CSP, policy_for(path).encode())]


def policy_for(path: str) -> str:
    return PAGE_POLICY if path == "/" or path.startswith("/static/") else DATA_POLICY


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                have = {name.lower() for name, _ in headers}
                headers.extend(header for header in COMMON if header[0] not in have)
                if _CSP not in have:
                    headers.append((_CSP, policy_for(path).encode()))
                else:
                    headers = [_framed(name, value) for name, value in headers]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


def _framed(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    if name.lower() != _CSP or b"frame-ancestors" in value:
        return name, value
    return name, value + b"; frame-ancestors 'none'"
