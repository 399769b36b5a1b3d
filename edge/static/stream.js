// One session's SSE stream, resumed after every break.
//
// Read with fetch(), not EventSource: EventSource cannot send headers, so
// its key would have to go in the URL (and from there into logs and
// histories). The key goes in the Authorization header; the body is parsed
// as server-sent events here. Whenever the stream ends (an HTTP error, a
// dropped connection, the gateway draining) it is opened again from the
// page's own cursor (`?after=`), after checking the session is still there.
"use strict";

import { currentKey, sessionPath } from "./api.js";
import { FACT_KINDS } from "./facts.js";

const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 15000;
const LINE_END = /\r\n|\r|\n/;

export class EventStream {
  /** `handlers`: fact, delta, status (SSE events: {type, data, lastEventId}),
   *  open(), connection(word), cursor() -> the last seq rendered, and
   *  resume() -> Promise<boolean> (false: do not reconnect, e.g. the key was
   *  rejected). */
  constructor(handlers) {
    this.handlers = handlers;
    this.sessionId = null;
    this.controller = null;
    this.timer = null;
    this.delay = RECONNECT_MIN_MS;
    this.listeners = new Map([
      ...FACT_KINDS.map((kind) => [kind, (event) => this.handlers.fact(event)]),
      // A frame without `event:` is a message; accepted if it looks like a
      // fact, so a kind this page does not know yet still advances the cursor.
      ["message", (event) => this.handlers.fact(event)],
      ["delta", (event) => this.handlers.delta(event)],
      ["status", (event) => this.handlers.status(event)],
      ["drain", (event) => this.onDrain(event)],
    ]);
  }

  /** Opens the stream of `sessionId` from `after` (0: from the start). */
  open(sessionId, after) {
    this.close();
    this.sessionId = sessionId;
    if (!sessionId || !currentKey()) return;
    const controller = new AbortController();
    this.controller = controller;
    this.handlers.connection("connecting");
    this.follow(controller, sessionId, after).then((ended) => {
      // Still this stream's turn: it ended (or never started), so resume.
      if (ended && this.controller === controller) {
        this.reconnect(this.delay);
        this.delay = Math.min(this.delay * 2, RECONNECT_MAX_MS);
      }
    });
  }

  /** Reads the stream until it ends; false when it was closed on purpose. */
  async follow(controller, sessionId, after) {
    const query = after > 0 ? `?${new URLSearchParams({ after: String(after) })}` : "";
    try {
      const response = await fetch(`${sessionPath(sessionId, "/events")}${query}`, {
        headers: { Authorization: `Bearer ${currentKey()}`, Accept: "text/event-stream" },
        cache: "no-store",
        signal: controller.signal,
      });
      const type = response.headers.get("content-type") || "";
      if (!response.ok || !type.startsWith("text/event-stream") || !response.body) {
        // The reason (a bad key, a missing session) is found by resume().
        if (response.body) await response.body.cancel();
        return true;
      }
      if (this.controller !== controller) return false;
      this.handlers.connection("open");
      this.delay = RECONNECT_MIN_MS;
      this.handlers.open();
      await this.read(controller, response.body);
      return true;
    } catch (error) {
      // Aborted: closed on purpose. Anything else: the connection broke.
      return !controller.signal.aborted;
    }
  }

  /** Parses the body as server-sent events (the WHATWG rules: `event`,
   *  `data`, `id`; comments and `retry` are ignored). */
  async read(controller, body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let frame = { type: "", data: [], id: null };
    let lastEventId = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      for (;;) {
        const match = LINE_END.exec(buffer);
        // A trailing CR may be the first half of a CRLF still on its way.
        if (!match || (match[0] === "\r" && match.index === buffer.length - 1)) break;
        const line = buffer.slice(0, match.index);
        buffer = buffer.slice(match.index + match[0].length);
        if (line === "") {
          if (frame.id !== null) lastEventId = frame.id;
          if (frame.data.length) {
            const event = { type: frame.type || "message", data: frame.data.join("\n"), lastEventId };
            const listener = this.listeners.get(event.type);
            if (this.controller !== controller) return;
            if (listener) listener(event);
          }
          frame = { type: "", data: [], id: null };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "event") frame.type = text;
        else if (field === "data") frame.data.push(text);
        else if (field === "id" && !text.includes("\0")) frame.id = text;
      }
    }
  }

  close() {
    if (this.controller) this.controller.abort();
    this.controller = null;
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
      if (this.sessionId !== sessionId || this.controller) return;
      if (go) this.open(sessionId, this.handlers.cursor());
      else this.handlers.connection("closed");
    }, delayMs);
  }

  /** The gateway is draining: it closes the stream and asks us to come back
   *  later, from the page's cursor (`?after=`): the first frame after that
   *  is cursor + 1. */
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
