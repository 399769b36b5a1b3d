// One session's SSE stream, resumed after every break.
//
// EventSource cannot set headers, hence `access_token`; after the first open
// the browser's own reconnects send Last-Event-ID with the last id it saw.
// When the browser gives up (an HTTP error) or the gateway drains, the stream
// is opened again from the page's own cursor (`?after=`).
"use strict";

import { currentKey, sessionPath } from "./api.js";
import { FACT_KINDS } from "./facts.js";

const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 15000;

export class EventStream {
  /** `handlers`: fact, delta, status (SSE events), open(), connection(word),
   *  cursor() -> the last seq rendered, and resume() -> Promise<boolean>
   *  (false: do not reconnect, e.g. the key was rejected). */
  constructor(handlers) {
    this.handlers = handlers;
    this.sessionId = null;
    this.source = null;
    this.timer = null;
    this.delay = RECONNECT_MIN_MS;
  }

  /** Opens the stream of `sessionId` from `after` (0: from the start). */
  open(sessionId, after) {
    this.close();
    this.sessionId = sessionId;
    if (!sessionId || !currentKey()) return;
    const params = new URLSearchParams({ access_token: currentKey() });
    if (after > 0) params.set("after", String(after));
    const source = new EventSource(`${sessionPath(sessionId, "/events")}?${params}`);
    this.source = source;
    this.handlers.connection("connecting");

    // Every listener checks it still belongs to the open stream: events
    // already queued on a closed EventSource can still be dispatched.
    const live = (handler) => (event) => {
      if (this.source === source) handler(event);
    };
    source.addEventListener(
      "open",
      live(() => {
        this.handlers.connection("open");
        this.delay = RECONNECT_MIN_MS;
        this.handlers.open();
      }),
    );
    for (const kind of FACT_KINDS) source.addEventListener(kind, live(this.handlers.fact));
    // A frame without `event:` is a message; accepted if it looks like a fact
    // so a kind this page does not know yet still advances the cursor.
    source.addEventListener("message", live(this.handlers.fact));
    source.addEventListener("delta", live(this.handlers.delta));
    source.addEventListener("status", live(this.handlers.status));
    source.addEventListener("drain", live((event) => this.onDrain(event)));
    source.addEventListener(
      "error",
      live(() => {
        if (source.readyState === EventSource.CLOSED) {
          // The browser gave up (an HTTP error or a wrong content type): it
          // will not retry by itself, so resume from our own cursor.
          this.reconnect(this.delay);
          this.delay = Math.min(this.delay * 2, RECONNECT_MAX_MS);
        } else {
          // CONNECTING: the browser retries on its own with Last-Event-ID.
          this.handlers.connection("connecting");
        }
      }),
    );
  }

  close() {
    if (this.source) this.source.close();
    this.source = null;
    clearTimeout(this.timer);
    this.timer = null;
    this.handlers.connection("closed");
  }

  reconnect(delayMs) {
    const sessionId = this.sessionId;
    this.close();
    this.sessionId = sessionId;
    this.handlers.connection("connecting");
    this.timer = setTimeout(async () => {
      if (this.sessionId !== sessionId) return;
      // Find out why the stream failed before hammering it: a bad key or a
      // missing session will not get better by retrying.
      const go = await this.handlers.resume();
      if (this.sessionId !== sessionId || this.source) return;
      if (go) this.open(sessionId, this.handlers.cursor());
      else this.handlers.connection("closed");
    }, delayMs);
  }

  /** The gateway is draining: it closes the stream and asks us to come back
   *  later. A fresh EventSource has no Last-Event-ID, so the cursor goes in
   *  `?after=`; the first frame after that is cursor + 1. */
  onDrain(event) {
    let retryAfter = 1000;
    try {
      const data = JSON.parse(event.data);
      if (Number.isFinite(data.retry_after_ms)) retryAfter = Math.max(0, data.retry_after_ms);
    } catch {
      // Keep the default delay.
    }
    this.reconnect(retryAfter);
  }
}
