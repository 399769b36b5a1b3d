// Keel web chat: a thin view over the edge's HTTP API and SSE stream.
//
// The ledger is the source of truth. This page renders committed facts in seq
// order and treats token partials ("delta" events) as disposable previews:
// a partial lives in a pending bubble keyed by its generationId until the
// `assistant` fact with that generationId commits, which replaces it. Nothing
// here is durable except the API key and the selected session, so a reload
// simply replays the session's facts from seq 1 and picks up the live stream.
"use strict";

const KEY_STORAGE = "keel.apiKey";

// Every committed fact kind the edge sends. EventSource has no wildcard
// listener, so each named event needs its own handler.
const FACT_KINDS = [
  "session_created",
  "input",
  "epoch_started",
  "assistant",
  "tool_result",
  "compaction",
  "attempt_failed",
  "cancelled",
  "session_parked",
  "compaction_failed",
];

const CANCELLED_STOP = "cancelled";
const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 15000;
// A partial that received nothing for this long belongs to a dead attempt
// when a new epoch starts (see applyFact).
const QUIET_PARTIAL_MS = 1000;

const $ = (selector) => document.querySelector(selector);

const els = {
  sessions: $("#sessions"),
  newSession: $("#new-session"),
  keyPanel: $("#key-panel"),
  keyForm: $("#key-form"),
  keyInput: $("#key-input"),
  title: $("#session-title"),
  status: $("#status"),
  connection: $("#connection"),
  cancel: $("#cancel"),
  notice: $("#notice"),
  transcript: $("#transcript"),
  facts: $("#facts"),
  pending: $("#pending"),
  composer: $("#composer"),
  textarea: $("#composer textarea"),
  send: $("#send"),
};

const state = {
  key: "",
  sessionId: null,
  // Bumped on every session switch so callbacks of an older stream or
  // request can tell they are stale and do nothing.
  generation: 0,
  source: null,
  reconnectTimer: null,
  reconnectDelay: RECONNECT_MIN_MS,
  // The highest seq rendered: the resume cursor for `?after=`.
  lastSeq: 0,
  // Seqs already rendered. The server never sends a fact twice on one
  // cursor, but a resume that overlaps (e.g. `?after=` and Last-Event-ID
  // disagreeing) must not show a fact twice.
  seen: new Set(),
  // generationIds whose assistant fact is rendered: a late delta for one of
  // them must not open a new pending bubble under the final answer.
  committed: new Set(),
  // generationId -> pending bubble (see makePending).
  pending: new Map(),
  toolNames: new Map(),
  inputs: new Map(),
  status: "idle",
  // Counts status events, to tell whether a fetched status is stale.
  statusEvents: 0,
  // The message being sent: a failed POST resent with the same text keeps
  // its requestId, so the server deduplicates it instead of committing twice.
  draft: null,
};

// ---------------------------------------------------------------- helpers

/** Builds an element. Text always goes through textContent (no HTML injection). */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "className") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** crypto.randomUUID exists only in secure contexts; plain http on a LAN
 *  address is not one, so fall back to getRandomValues (available everywhere). */
function newRequestId() {
  if (typeof crypto.randomUUID === "function") return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  bytes[6] = (bytes[6] & 0x0f) | 0x40;
  bytes[8] = (bytes[8] & 0x3f) | 0x80;
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function formatTime(timestamp) {
  if (timestamp === undefined || timestamp === null) return undefined;
  const date = new Date(timestamp);
  return Number.isNaN(date.getTime()) ? undefined : date.toLocaleString();
}

function asText(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

/** The hash carries `key=` (from the link `keel up` prints) and `session=`.
 *  Parsed by hand: URLSearchParams would turn a "+" in a key into a space. */
function readHash() {
  const values = {};
  for (const part of location.hash.replace(/^#/, "").split("&")) {
    if (!part) continue;
    const at = part.indexOf("=");
    const name = at < 0 ? part : part.slice(0, at);
    const raw = at < 0 ? "" : part.slice(at + 1);
    try {
      values[decodeURIComponent(name)] = decodeURIComponent(raw);
    } catch {
      values[name] = raw;
    }
  }
  return values;
}

/** Keeps only the session in the address bar: the key must not linger in
 *  the URL (history, screenshots, shared links); localStorage holds it. */
function writeHash(sessionId) {
  const hash = sessionId ? `#session=${encodeURIComponent(sessionId)}` : "";
  history.replaceState(null, "", `${location.pathname}${location.search}${hash}`);
}

function showNotice(message) {
  els.notice.textContent = message;
  els.notice.hidden = !message;
}

// -------------------------------------------------------------------- API

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** One JSON request. Paths are relative so the page also works behind a
 *  proxy that mounts the edge under a prefix. */
async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let payload = null;
  if (text) {
    try {
      payload = JSON.parse(text);
    } catch {
      payload = null;
    }
  }
  if (!response.ok) {
    const error = payload && payload.error ? payload.error : {};
    throw new ApiError(
      response.status,
      error.code || String(response.status),
      error.message || `${response.status} ${response.statusText}`,
    );
  }
  return payload;
}

function sessionPath(id, suffix = "") {
  return `v1/sessions/${encodeURIComponent(id)}${suffix}`;
}

function reportError(error) {
  if (error instanceof ApiError && error.status === 401) {
    showNotice("The API key was rejected. Paste a valid key under “API key”.");
    els.keyPanel.open = true;
  } else {
    showNotice(error instanceof Error ? error.message : String(error));
  }
}

// ---------------------------------------------------------------- sessions

async function loadSessions() {
  if (!state.key) return;
  try {
    const { sessions } = await api("GET", "v1/sessions");
    renderSessions(sessions || []);
  } catch (error) {
    reportError(error);
  }
}

function renderSessions(sessions) {
  const items = sessions.map((session) => {
    // The open session's count comes from the live stream, which is newer.
    const head = session.id === state.sessionId ? Math.max(state.lastSeq, session.headSeq) : session.headSeq;
    return h(
      "li",
      {
        role: "option",
        dataset: { sessionId: session.id },
        "aria-selected": session.id === state.sessionId ? "true" : "false",
        title: session.id,
        onclick: () => selectSession(session.id),
      },
      h("span", { className: "session-id" }, session.id),
      h("span", { className: "head-seq" }, `#${head}`),
    );
  });
  if (items.length === 0) items.push(h("li", { className: "empty" }, "No sessions yet"));
  els.sessions.replaceChildren(...items);
}

function markSelected() {
  for (const li of els.sessions.querySelectorAll("li[data-session-id]")) {
    li.setAttribute("aria-selected", li.dataset.sessionId === state.sessionId ? "true" : "false");
  }
}

function updateHeadSeq() {
  const li = [...els.sessions.querySelectorAll("li[data-session-id]")].find(
    (item) => item.dataset.sessionId === state.sessionId,
  );
  if (li) li.querySelector(".head-seq").textContent = `#${state.lastSeq}`;
}

async function createSession() {
  els.newSession.disabled = true;
  try {
    const { id } = await api("POST", "v1/sessions", {});
    await loadSessions();
    selectSession(id);
  } catch (error) {
    reportError(error);
  } finally {
    els.newSession.disabled = false;
  }
}

/** Opens a session: forget everything about the previous one and replay
 *  this one's facts from the start. */
function selectSession(id) {
  closeStream();
  state.generation += 1;
  state.sessionId = id;
  state.lastSeq = 0;
  state.seen.clear();
  state.committed.clear();
  state.pending.clear();
  state.toolNames.clear();
  state.inputs.clear();
  state.draft = null;
  els.facts.replaceChildren();
  els.pending.replaceChildren();
  els.title.textContent = id;
  els.textarea.disabled = false;
  els.send.disabled = false;
  showNotice("");
  writeHash(id);
  markSelected();
  setStatus("idle");
  refreshSessionState();
  openStream(0);
  els.textarea.focus();
}

/** Status events only announce changes, so the state at open time (and
 *  "parked", which has no status event) comes from the session resource. */
async function refreshSessionState() {
  const generation = state.generation;
  const events = state.statusEvents;
  try {
    const session = await api("GET", sessionPath(state.sessionId));
    applyFetchedStatus(generation, events, session.status);
  } catch (error) {
    if (generation !== state.generation) return;
    if (error instanceof ApiError && error.status === 404) {
      showNotice(`Session ${state.sessionId} does not exist for this key.`);
      closeStream();
      return;
    }
    reportError(error);
  }
}

// ------------------------------------------------------------------ stream

/** Opens the SSE stream from `after` (0: from the start). EventSource
 *  cannot set headers, hence `access_token`; after this first open the
 *  browser's own reconnects send Last-Event-ID with the last id it saw. */
function openStream(after) {
  if (!state.sessionId || !state.key) return;
  const generation = state.generation;
  const params = new URLSearchParams({ access_token: state.key });
  if (after > 0) params.set("after", String(after));
  const source = new EventSource(`${sessionPath(state.sessionId, "/events")}?${params}`);
  state.source = source;
  setConnection("connecting");

  // Every listener checks it still belongs to the open stream: events
  // already queued on a closed EventSource can still be dispatched.
  const live = (handler) => (event) => {
    if (state.source === source && generation === state.generation) handler(event);
  };

  source.addEventListener(
    "open",
    live(() => {
      setConnection("open");
      state.reconnectDelay = RECONNECT_MIN_MS;
      // Partials are not facts: whatever streamed before this connection
      // may have a gap now. Drop them; the live stream starts new ones and
      // the committed answer is always complete.
      dropPending();
    }),
  );
  for (const kind of FACT_KINDS) source.addEventListener(kind, live(onFact));
  // A frame without `event:` is a message; accept it if it looks like a fact
  // so a kind this page does not know yet still advances the cursor.
  source.addEventListener("message", live(onFact));
  source.addEventListener("delta", live(onDelta));
  source.addEventListener("status", live(onStatus));
  source.addEventListener("drain", live(onDrain));
  source.addEventListener(
    "error",
    live(() => {
      if (source.readyState === EventSource.CLOSED) {
        // The browser gave up (an HTTP error or a wrong content type): it
        // will not retry by itself, so resume from our own cursor.
        scheduleReconnect(state.reconnectDelay);
        state.reconnectDelay = Math.min(state.reconnectDelay * 2, RECONNECT_MAX_MS);
      } else {
        // CONNECTING: the browser retries on its own with Last-Event-ID.
        setConnection("connecting");
      }
    }),
  );
}

function closeStream() {
  if (state.source) state.source.close();
  state.source = null;
  clearTimeout(state.reconnectTimer);
  state.reconnectTimer = null;
  setConnection("closed");
}

function scheduleReconnect(delayMs) {
  closeStream();
  setConnection("connecting");
  const generation = state.generation;
  state.reconnectTimer = setTimeout(async () => {
    if (generation !== state.generation) return;
    // Find out why the stream failed before hammering it: a bad key or a
    // missing session will not get better by retrying.
    const events = state.statusEvents;
    try {
      const session = await api("GET", sessionPath(state.sessionId));
      applyFetchedStatus(generation, events, session.status);
    } catch (error) {
      if (generation !== state.generation) return;
      if (error instanceof ApiError && (error.status === 401 || error.status === 404)) {
        reportError(error);
        setConnection("closed");
        return;
      }
    }
    openStream(state.lastSeq);
  }, delayMs);
}

/** The gateway is draining: it closes the stream and asks us to come back
 *  later. A fresh EventSource has no Last-Event-ID, so the cursor goes in
 *  `?after=`; the first frame after that is lastSeq + 1. */
function onDrain(event) {
  let retryAfter = 1000;
  try {
    const data = JSON.parse(event.data);
    if (Number.isFinite(data.retry_after_ms)) retryAfter = Math.max(0, data.retry_after_ms);
  } catch {
    // Keep the default delay.
  }
  scheduleReconnect(retryAfter);
}

function onStatus(event) {
  state.statusEvents += 1;
  try {
    setStatus(JSON.parse(event.data).state);
  } catch {
    // A malformed status is not worth breaking the stream for.
  }
}

/** A fetched status is older than any status event that arrived while the
 *  request was in flight; only an unchallenged one is applied. */
function applyFetchedStatus(generation, eventsBefore, status) {
  if (generation === state.generation && state.statusEvents === eventsBefore) setStatus(status);
}

/** Says nothing while the stream is live; a resume in progress is shown
 *  so a quiet transcript is not mistaken for an idle session. */
function setConnection(connection) {
  els.connection.dataset.state = connection;
  els.connection.textContent =
    connection === "connecting" ? "connecting…" : connection === "closed" && state.sessionId ? "offline" : "";
}

function setStatus(status) {
  if (!status) return;
  state.status = status;
  els.status.dataset.state = status;
  els.status.textContent =
    status === "running" ? "running…" : status === "compacting" ? "compacting…" : status;
  // Cancel is offered only while an answer is being produced. Nothing else
  // is disabled while busy: inputs sent now are committed and queued.
  els.cancel.hidden = status !== "running";
  // Idle means no answer is in flight: a pending bubble left now belongs to
  // a generation that will never commit under that id (a crash, a cancel).
  if (status === "idle" || status === "parked") dropPending();
}

// ------------------------------------------------------------------- facts

function onFact(event) {
  let fact;
  try {
    fact = JSON.parse(event.data);
  } catch {
    return;
  }
  if (!fact || typeof fact !== "object" || !fact.kind) return;
  const seq = Number(fact.seq ?? event.lastEventId);
  if (!Number.isSafeInteger(seq) || seq <= 0) return;
  // The safety net: a fact already on screen is never rendered again.
  if (state.seen.has(seq)) return;
  state.seen.add(seq);
  fact.seq = seq;
  fact.data = fact.data || {};

  const stick = nearBottom();
  const el = renderFact(fact);
  el.dataset.seq = String(seq);
  el.dataset.kind = fact.kind;
  const when = formatTime(fact.timestamp);
  if (when) el.title = when;
  insertInOrder(el, seq);
  applyFact(fact);
  state.lastSeq = Math.max(state.lastSeq, seq);
  updateHeadSeq();
  if (stick) scrollToBottom();
}

/** Facts arrive in seq order; this keeps the order even if a resume ever
 *  fills a gap late. The common case (append at the end) is checked first. */
function insertInOrder(el, seq) {
  const last = els.facts.lastElementChild;
  if (!last || Number(last.dataset.seq) < seq) {
    els.facts.append(el);
    return;
  }
  for (const child of els.facts.children) {
    if (Number(child.dataset.seq) > seq) {
      els.facts.insertBefore(el, child);
      return;
    }
  }
  els.facts.append(el);
}

/** What a fact changes besides its own bubble. */
function applyFact(fact) {
  const data = fact.data;
  switch (fact.kind) {
    case "assistant":
      state.committed.add(data.generationId);
      removePending(data.generationId);
      if (data.stopReason === CANCELLED_STOP) {
        // The cancelled generation (another id) will never commit.
        dropPending();
        for (const seq of data.inputSeqs || []) {
          const input = state.inputs.get(seq);
          if (input) input.classList.add("cancelled");
        }
      }
      break;
    case "epoch_started":
      // A new owner streams the answer again from its first token under the
      // same generationId: partials of an older epoch must not be glued in
      // front of it. Deltas and facts travel different paths, so the first
      // tokens of the new epoch may overtake its epoch_started; a partial
      // without an epoch tag is only taken for dead when it has gone quiet.
      for (const [id, pending] of [...state.pending]) {
        const older =
          pending.epoch !== undefined
            ? pending.epoch < data.epoch
            : performance.now() - pending.lastDeltaAt > QUIET_PARTIAL_MS;
        if (older) removePending(id);
      }
      break;
    case "attempt_failed":
    case "session_parked":
      // The failed attempt's partials will never commit; a retry restarts.
      dropPending();
      if (fact.kind === "session_parked") setStatus("parked");
      break;
    default:
      break;
  }
}

function renderFact(fact) {
  const data = fact.data;
  switch (fact.kind) {
    case "input":
      return renderInput(fact);
    case "assistant":
      return renderAssistant(fact);
    case "tool_result":
      return renderToolResult(data);
    case "compaction":
      return renderCompaction(data);
    case "session_created":
      return h("div", { className: "notice" }, "Session created");
    case "epoch_started":
      // Every claim starts an epoch; users care about answers, not owners.
      return h("div", { className: "fact-hidden", hidden: true });
    case "attempt_failed": {
      const again = data.retryable ? " — retrying" : "";
      return h("div", { className: "notice warn" }, `Attempt failed: ${data.error}${again}`);
    }
    case "cancelled":
      return h("div", { className: "notice" }, "Cancel requested");
    case "session_parked":
      return h("div", { className: "notice error" }, `Session parked: ${data.reason}`);
    case "compaction_failed":
      return h("div", { className: "notice warn" }, `Compaction failed: ${data.error}`);
    default:
      return h("div", { className: "notice" }, `${fact.kind} fact`);
  }
}

function renderInput(fact) {
  const data = fact.data;
  const el = h(
    "div",
    { className: "bubble fact-input" },
    h(
      "div",
      { className: "meta" },
      h("span", {}, `#${fact.seq}`),
      data.retryOf ? h("span", {}, `retry of #${data.retryOf}`) : null,
      h("span", { className: "spacer" }),
      h(
        "button",
        { type: "button", className: "retry", title: "Ask this again", onclick: () => retryInput(fact.seq) },
        "Retry",
      ),
    ),
    h("div", { className: "text" }, data.text),
  );
  state.inputs.set(fact.seq, el);
  return el;
}

function renderAssistant(fact) {
  const data = fact.data;
  if (data.stopReason === CANCELLED_STOP && !(data.content || []).length && !(data.toolCalls || []).length) {
    return h("div", { className: "bubble fact-assistant cancelled" }, "Answer cancelled");
  }
  const meta = [h("span", {}, `#${fact.seq}`)];
  if (data.model) meta.push(h("span", {}, data.model));
  if (data.stopReason === "length") meta.push(h("span", {}, "cut at the output limit"));
  if (data.stopReason === CANCELLED_STOP) meta.push(h("span", {}, "cancelled"));
  const el = h("div", {
    className: `bubble fact-assistant${data.stopReason === CANCELLED_STOP ? " cancelled" : ""}`,
    dataset: { generationId: data.generationId },
  });
  el.append(h("div", { className: "meta" }, meta));
  for (const block of data.content || []) {
    if (block.type === "thinking") el.append(thinkingBlock("Thinking", h("pre", {}, block.thinking)));
    else if (block.type === "text") el.append(h("div", { className: "text" }, block.text));
  }
  for (const call of data.toolCalls || []) {
    state.toolNames.set(call.id, call.name);
    el.append(
      h(
        "div",
        { className: "tool-call", dataset: { toolCallId: call.id } },
        h("div", { className: "tool-name" }, `Tool call: ${call.name}`),
        h("pre", {}, asText(call.arguments || {})),
      ),
    );
  }
  return el;
}

/** Collapsed: thinking is there to inspect, not to read by default. */
function thinkingBlock(label, pre) {
  return h("details", { className: "thinking" }, h("summary", {}, label), pre);
}

function renderToolResult(data) {
  const name = state.toolNames.get(data.toolCallId) || data.toolCallId;
  return h(
    "div",
    { className: `bubble fact-tool_result${data.isError ? " error" : ""}`, dataset: { toolCallId: data.toolCallId } },
    h("div", { className: "meta" }, `${name} ${data.isError ? "failed" : "returned"}`),
    h("pre", {}, asText(data.content)),
  );
}

function renderCompaction(data) {
  const before = data.tokensBefore;
  const after = data.tokensAfter;
  let headline = "Context compacted";
  if (Number.isFinite(before) && Number.isFinite(after)) headline += `: ${before} → ${after} tokens`;
  else if (Number.isFinite(before)) headline += `: ${before} tokens summarized`;
  const range = Array.isArray(data.summarized) && data.summarized.length === 2 ? data.summarized : null;
  if (range) headline += ` (facts #${range[0]}–#${range[1]})`;
  return h(
    "details",
    { className: "maintenance" },
    h("summary", {}, headline),
    h("pre", {}, data.summary || ""),
  );
}

// ---------------------------------------------------------------- partials

function onDelta(event) {
  let delta;
  try {
    delta = JSON.parse(event.data);
  } catch {
    return;
  }
  const id = delta.generationId;
  if (!id || typeof delta.text !== "string") return;
  // Already committed: the final answer is on screen; the partial is moot.
  if (state.committed.has(id)) return;
  const stick = nearBottom();
  let pending = state.pending.get(id);
  // A successor (new epoch) streams the same generationId again from its
  // first token: start over rather than glue two attempts together. Only
  // possible when the edge tags deltas with an epoch; see also applyFact.
  if (pending && delta.epoch !== undefined && pending.epoch !== undefined && pending.epoch !== delta.epoch) {
    removePending(id);
    pending = undefined;
  }
  if (!pending) {
    pending = makePending(id, delta.epoch);
    state.pending.set(id, pending);
    els.pending.append(pending.el);
  }
  pending.append(delta.channel, delta.text);
  if (stick) scrollToBottom();
}

/** A bubble for one in-flight generation, with a part per channel. */
function makePending(generationId, epoch) {
  const text = h("div", { className: "text" });
  const el = h("div", { className: "bubble pending-assistant", dataset: { generationId } });
  let thinking = null;
  let toolCalls = null;
  el.append(h("div", { className: "meta" }, "answering…"), text);
  return {
    el,
    epoch,
    lastDeltaAt: performance.now(),
    append(channel, chunk) {
      this.lastDeltaAt = performance.now();
      if (channel === "thinking") {
        if (!thinking) {
          thinking = h("pre");
          el.insertBefore(thinkingBlock("Thinking…", thinking), text);
        }
        thinking.append(chunk);
      } else if (channel === "tool_call") {
        if (!toolCalls) {
          toolCalls = h("pre");
          el.append(h("div", { className: "tool-call" }, h("div", { className: "tool-name" }, "Tool call"), toolCalls));
        }
        toolCalls.append(chunk);
      } else {
        text.append(chunk);
      }
    },
  };
}

function removePending(generationId) {
  const pending = state.pending.get(generationId);
  if (pending) pending.el.remove();
  state.pending.delete(generationId);
}

function dropPending() {
  for (const id of [...state.pending.keys()]) removePending(id);
}

// ------------------------------------------------------------------ scroll

function nearBottom() {
  const t = els.transcript;
  return t.scrollHeight - t.scrollTop - t.clientHeight < 80;
}

function scrollToBottom() {
  els.transcript.scrollTop = els.transcript.scrollHeight;
}

// ---------------------------------------------------------------- commands

async function sendInput() {
  const text = els.textarea.value.trim();
  if (!text || !state.sessionId) return;
  // A fresh requestId per message; the same one again only when the very
  // same message is resent after a failure (the server answers 200 with the
  // original seq instead of committing it twice).
  if (!state.draft || state.draft.text !== text) state.draft = { text, requestId: newRequestId() };
  const { requestId } = state.draft;
  const generation = state.generation;
  els.send.disabled = true;
  try {
    await api("POST", sessionPath(state.sessionId, "/inputs"), { text, requestId });
    if (generation !== state.generation) return;
    state.draft = null;
    if (els.textarea.value.trim() === text) els.textarea.value = "";
    showNotice("");
    scrollToBottom();
  } catch (error) {
    if (generation === state.generation) reportError(error);
  } finally {
    els.send.disabled = false;
  }
}

async function retryInput(seq) {
  try {
    await api("POST", sessionPath(state.sessionId, "/retry"), { seq });
    showNotice("");
  } catch (error) {
    reportError(error);
  }
}

async function cancelRun() {
  els.cancel.disabled = true;
  try {
    await api("POST", sessionPath(state.sessionId, "/cancel"), {});
    showNotice("");
  } catch (error) {
    reportError(error);
  } finally {
    els.cancel.disabled = false;
  }
}

// -------------------------------------------------------------------- key

function setKey(key) {
  state.key = key;
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  els.keyInput.value = "";
  els.keyInput.placeholder = key ? `•••• ${key.slice(-4)}` : "Paste an API key";
}

/** Reads `#key=` and `#session=`; returns the session to open, if any. */
function takeHash() {
  const values = readHash();
  if (values.key) setKey(values.key);
  const session = values.session || null;
  writeHash(session);
  return session;
}

function start(sessionId) {
  if (!state.key) {
    showNotice("No API key yet: open the link `keel up` printed, or paste a key under “API key”.");
    els.keyPanel.open = true;
    return;
  }
  showNotice("");
  loadSessions();
  if (sessionId) selectSession(sessionId);
}

// ------------------------------------------------------------------- wiring

els.newSession.addEventListener("click", createSession);
els.cancel.addEventListener("click", cancelRun);
els.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  sendInput();
});
els.textarea.addEventListener("keydown", (event) => {
  // Enter sends; Shift+Enter is a newline; an IME composition is left alone.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    sendInput();
  }
});
els.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = els.keyInput.value.trim();
  if (!key) return;
  setKey(key);
  els.keyPanel.open = false;
  start(state.sessionId);
});
// Pasting a new `#key=…` link into an open tab changes only the hash.
window.addEventListener("hashchange", () => {
  const session = takeHash();
  start(session || state.sessionId);
});
// Another tab may have created sessions meanwhile.
window.addEventListener("focus", loadSessions);

setKey(localStorage.getItem(KEY_STORAGE) || "");
start(takeHash());
