// Keel web chat: a thin view over the edge's HTTP API and SSE stream.
//
// The ledger is the source of truth. This page renders committed facts in seq
// order and treats token partials ("delta" events) as disposable previews
// (see previews.js). Nothing here is durable except the API key and the
// selected session, so a reload simply replays the session's facts from seq 1
// and picks up the live stream. The same stream feeds the inspector
// (inspector.js) with live facts.
"use strict";

import { ApiError, api, currentKey, sessionPath, storeKey, storedKey } from "./api.js";
import { $, formatTime, h, newRequestId, readHash, writeHash } from "./dom.js";
import { CANCELLED_STOP, pendingApprovals, renderFact, settleApproval, settleParked } from "./facts.js";
import { Inspector } from "./inspector.js";
import { Previews } from "./previews.js";
import { EventStream } from "./stream.js";

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
  views: $("#views"),
  notice: $("#notice"),
  chatView: $("#chat-view"),
  transcript: $("#transcript"),
  facts: $("#facts"),
  pending: $("#pending"),
  composer: $("#composer"),
  textarea: $("#composer textarea"),
  send: $("#send"),
};

const state = {
  sessionId: null,
  view: "chat",
  // Bumped on every session switch so callbacks of an older request can
  // tell they are stale and do nothing.
  generation: 0,
  // The highest seq rendered: the resume cursor for `?after=`.
  lastSeq: 0,
  // Seqs already rendered. The server never sends a fact twice on one
  // cursor, but a resume that overlaps (e.g. `?after=` and Last-Event-ID
  // disagreeing) must not show a fact twice.
  seen: new Set(),
  status: "idle",
  // Counts status events, to tell whether a fetched status is stale.
  statusEvents: 0,
  // The message being sent: a failed POST resent with the same text keeps
  // its requestId, so the server deduplicates it instead of committing twice.
  draft: null,
};

const previews = new Previews(els.pending);
const factView = {
  toolNames: new Map(),
  inputs: new Map(),
  approvals: new Map(),
  parked: null,
  onRetry: retryInput,
  onEdit: editInput,
  onSkip: skipFailed,
  onDecide: decideApproval,
};
const inspector = new Inspector($("#inspector"), reportError);

function showNotice(message) {
  els.notice.textContent = message;
  els.notice.hidden = !message;
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
  if (!currentKey()) return;
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
  stream.close();
  state.generation += 1;
  state.sessionId = id;
  state.lastSeq = 0;
  state.seen.clear();
  previews.clear();
  factView.toolNames.clear();
  factView.inputs.clear();
  factView.approvals.clear();
  factView.parked = null;
  state.draft = null;
  els.facts.replaceChildren();
  els.title.textContent = id;
  els.textarea.disabled = false;
  els.send.disabled = false;
  els.views.hidden = false;
  showNotice("");
  markSelected();
  setStatus("idle");
  refreshSessionState();
  stream.open(id, 0);
  showView(state.view);
}

/** Chat or inspector: both follow the same session; only one is shown. */
function showView(view) {
  state.view = view === "inspector" ? "inspector" : "chat";
  for (const tab of els.views.querySelectorAll("button[data-view]")) {
    tab.setAttribute("aria-selected", tab.dataset.view === state.view ? "true" : "false");
  }
  els.chatView.hidden = state.view !== "chat";
  inspector.show(state.view === "inspector" ? state.sessionId : null);
  writeHash(state.sessionId, state.view);
  if (state.view === "chat") els.textarea.focus();
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
      stream.close();
      return;
    }
    reportError(error);
  }
}

// ------------------------------------------------------------------ stream

const stream = new EventStream({
  fact: onFact,
  delta: onDelta,
  status: onStatus,
  // Partials are not facts: whatever streamed before this connection may
  // have a gap now. Drop them; the live stream starts new ones and the
  // committed answer is always complete.
  open: () => previews.drop(),
  connection: setConnection,
  cursor: () => state.lastSeq,
  resume: resumeCheck,
});

/** Before a reconnect: is the session still there for this key? */
async function resumeCheck() {
  const generation = state.generation;
  const events = state.statusEvents;
  try {
    const session = await api("GET", sessionPath(state.sessionId));
    applyFetchedStatus(generation, events, session.status);
  } catch (error) {
    if (generation !== state.generation) return false;
    if (error instanceof ApiError && (error.status === 401 || error.status === 404)) {
      reportError(error);
      return false;
    }
  }
  return generation === state.generation;
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

const STATUS_WORDS = {
  running: "running…",
  compacting: "compacting the context…",
  awaiting_approval: "waiting for approval",
};

/** What the bar says. Nothing runs while a tool call waits for a person
 *  (the stream says "idle"); the transcript's waiting cards tell the two
 *  apart, and settle as soon as the decision's fact arrives. */
function shownStatus(status) {
  const resting = status === "idle" || status === "awaiting_approval";
  if (!resting) return status;
  // A park lasts until its inputs are skipped or an attempt runs again,
  // whatever the stream said when the failed attempt ended.
  if (factView.parked) return "parked";
  return pendingApprovals(factView) > 0 ? "awaiting_approval" : "idle";
}

function setStatus(status) {
  if (!status) return;
  state.status = status;
  const shown = shownStatus(status);
  els.status.dataset.state = shown;
  els.status.textContent = STATUS_WORDS[shown] || shown;
  // Cancel is offered while an answer is being produced, a call waits (a
  // cancel closes it), or the session is parked (it settles what is owed).
  // Nothing else is disabled while busy: inputs sent now are committed and
  // queued.
  els.cancel.hidden = !["running", "awaiting_approval", "parked"].includes(shown);
  // Idle means no answer is in flight: a preview left now belongs to a
  // generation that will never commit under that id (a crash, a cancel).
  if (shown !== "running" && shown !== "compacting") previews.drop();
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
  const el = renderFact(fact, factView);
  el.dataset.seq = String(seq);
  el.dataset.kind = fact.kind;
  const when = formatTime(fact.timestamp);
  if (when) el.title = when;
  insertInOrder(el, seq);
  applyFact(fact);
  inspector.liveFact(state.sessionId, fact);
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
      previews.commit(data.generationId);
      if (data.stopReason === CANCELLED_STOP) {
        // The cancelled generation (another id) will never commit.
        previews.drop();
        for (const seq of data.inputSeqs || []) {
          const input = factView.inputs.get(seq);
          if (input) input.classList.add("cancelled");
        }
      }
      break;
    case "epoch_started":
      // A new owner streams the answer again from its first token under the
      // same generationId: previews of older epochs were cut off.
      previews.dropOlderThan(data.epoch);
      settleParked(factView);
      setStatus(state.status);
      break;
    case "inputs_skipped":
      settleParked(factView);
      setStatus(state.status);
      break;
    case "attempt_failed":
      // The failed attempt's previews will never commit; a retry restarts.
      previews.dropUpTo(fact.epoch);
      break;
    case "session_parked":
      previews.drop();
      setStatus("parked");
      break;
    case "approval_requested":
      setStatus(state.status);
      break;
    case "approval":
      settleApproval(factView, data.toolCallId, data.approve ? "approved" : "denied");
      setStatus(state.status);
      break;
    case "tool_result":
      // A call closed without a decision (a cancel) waits no more.
      settleApproval(factView, data.toolCallId, "closed without a decision");
      setStatus(state.status);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------- partials

function onDelta(event) {
  let delta;
  try {
    delta = JSON.parse(event.data);
  } catch {
    return;
  }
  if (!delta || typeof delta !== "object") return;
  const stick = nearBottom();
  if (previews.delta(delta) && stick) scrollToBottom();
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

/** Edit and resend: the edited message goes to a new session forked just
 *  before this one's message (POST …/edit), which the page then opens. */
async function editInput(seq, text) {
  const edited = window.prompt("Edit the message; it is sent in a new session forked before it", text);
  if (edited === null || !edited.trim()) return;
  try {
    const forked = await api("POST", sessionPath(state.sessionId, "/edit"), {
      seq,
      text: edited.trim(),
      requestId: newRequestId(),
    });
    await loadSessions();
    selectSession(forked.id);
  } catch (error) {
    reportError(error);
  }
}

async function skipFailed() {
  try {
    await api("POST", sessionPath(state.sessionId, "/skip"), {});
    showNotice("");
  } catch (error) {
    reportError(error);
  }
}

/** A person's decision on a waiting call; the card settles when the
 *  decision's fact arrives on the stream, like every other change. */
async function decideApproval(toolCallId, approve, note) {
  const body = { toolCallId, approve };
  if (note) body.note = note;
  try {
    await api("POST", sessionPath(state.sessionId, "/approvals"), body);
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
  storeKey(key);
  els.keyInput.value = "";
  els.keyInput.placeholder = key ? `•••• ${key.slice(-4)}` : "Paste an API key";
}

/** Reads `#key=`, `#session=` and `#view=`; returns the session to open, if any. */
function takeHash() {
  const values = readHash();
  if (values.key) setKey(values.key);
  if (values.view) state.view = values.view === "inspector" ? "inspector" : "chat";
  const session = values.session || null;
  writeHash(session, state.view);
  return session;
}

function start(sessionId) {
  if (!currentKey()) {
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
for (const tab of els.views.querySelectorAll("button[data-view]")) {
  tab.addEventListener("click", () => showView(tab.dataset.view));
}
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

setKey(storedKey());
start(takeHash());
