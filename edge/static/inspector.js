// The session inspector: every fact of a session on a timeline of epoch
// bands, so recovery can be checked at a glance: where an epoch began and
// why (a takeover is marked, with the runtime change and what was redone),
// what each compaction summarized, and for any answer, exactly what the
// model saw. Facts come from the paged JSON read of the events resource,
// then live from the chat's SSE stream.
"use strict";

import { api, readFacts, sessionPath } from "./api.js";
import { renderContext } from "./context-view.js";
import { formatClock, formatTime, generationHead, h, oneLine } from "./dom.js";
import { TRANSITIONS, buildTimeline, describeOwed } from "./timeline.js";

const KIND_LABELS = {
  session_created: "created",
  input: "input",
  epoch_started: "epoch",
  assistant: "answer",
  tool_result: "tool result",
  compaction: "compaction",
  attempt_failed: "failed",
  cancelled: "cancel",
  session_parked: "parked",
  compaction_failed: "compaction failed",
  approval_requested: "asks approval",
  approval: "decision",
  inputs_skipped: "skipped",
  forked_from: "forked",
};

function textOf(content) {
  if (typeof content === "string") return content;
  return (content || [])
    .filter((block) => block && block.type === "text")
    .map((block) => block.text)
    .join(" ");
}

/** The one-line description of a fact on its row. */
function describe(fact, toolNames) {
  const data = fact.data || {};
  switch (fact.kind) {
    case "session_created":
      return "session created";
    case "input": {
      const extra = [];
      if (data.retryOf) extra.push(`retry of #${data.retryOf}`);
      if ((data.blobs || []).length) extra.push(`${data.blobs.length} attachment(s)`);
      return `${oneLine(data.text)}${extra.length ? ` (${extra.join(", ")})` : ""}`;
    }
    case "epoch_started":
      return `epoch ${data.epoch} started, read up to #${data.watermark}`;
    case "assistant": {
      const parts = [oneLine(textOf(data.content)) || "(no text)"];
      for (const call of data.toolCalls || []) parts.push(`→ ${call.name}`);
      return parts.join(" ");
    }
    case "tool_result": {
      const name = toolNames.get(data.toolCallId) || data.toolCallId;
      return `${name} ${data.isError ? "failed" : "returned"}: ${oneLine(typeof data.content === "string" ? data.content : JSON.stringify(data.content), 80)}`;
    }
    case "compaction": {
      const range = Array.isArray(data.summarized) ? `#${data.summarized[0]}–#${data.summarized[1]}` : "?";
      const tokens = Number.isFinite(data.tokensBefore) && Number.isFinite(data.tokensAfter) ? ` · ${data.tokensBefore} → ${data.tokensAfter} tokens` : "";
      return `summarized ${range} · first kept #${data.firstKept}${tokens}`;
    }
    case "attempt_failed":
      return `${data.error}${data.retryable ? " (will retry)" : ""}`;
    case "cancelled":
      return "cancel requested";
    case "session_parked": {
      const on = (data.inputSeqs || []).map((seq) => `#${seq}`).join(", ");
      return `${on ? `on ${on}: ` : ""}${data.reason ?? ""}`;
    }
    case "forked_from":
      return `from ${String(data.sessionId ?? "").split(":").pop()} at #${data.seq}`;
    case "inputs_skipped":
      return `${(data.inputSeqs || []).map((seq) => `#${seq}`).join(", ")}: ${data.reason ?? ""}`;
    case "compaction_failed":
      return String(data.error ?? "");
    case "approval_requested":
      return `${data.name} waits for a decision: ${oneLine(JSON.stringify(data.arguments ?? {}), 80)}`;
    case "approval": {
      const name = toolNames.get(data.toolCallId) || data.toolCallId;
      return `${data.approve ? "approved" : "denied"} ${name} (by ${data.by})${data.note ? `: ${oneLine(data.note, 80)}` : ""}`;
    }
    default:
      return fact.kind;
  }
}

function chip(label, value, title) {
  return h("span", { className: "chip", title }, h("span", { className: "chip-label" }, label), ` ${value}`);
}

/** Ids are long; the first characters tell them apart (the title has all). */
function shortId(id, keep = 16) {
  return id && id.length > keep ? `${id.slice(0, keep - 1)}…` : id || "?";
}

export class Inspector {
  constructor(root, reportError) {
    this.root = root;
    this.reportError = reportError;
    this.summary = root.querySelector(".inspector-summary");
    this.timeline = root.querySelector(".timeline");
    this.panel = root.querySelector(".context-panel");
    this.sessionId = null;
    this.visible = false;
    this.facts = new Map();
    this.loaded = false;
    this.loading = null;
    this.dirty = false;
    this.frame = 0;
    this.selected = null;
    this.contextRequest = 0;
  }

  /** Shows the inspector for `sessionId`, or hides it (null). */
  show(sessionId) {
    this.visible = sessionId !== null;
    this.root.hidden = !this.visible;
    if (!this.visible) return;
    if (sessionId !== this.sessionId) this.reset(sessionId);
    if (!this.loaded && !this.loading) this.load();
    this.schedule();
  }

  reset(sessionId) {
    this.sessionId = sessionId;
    this.facts = new Map();
    this.loaded = false;
    this.loading = null;
    this.selected = null;
    this.contextRequest += 1;
    this.timeline.replaceChildren();
    this.panel.replaceChildren(h("p", { className: "hint" }, "Pick an answer’s “What the model saw” to see its request here."));
  }

  /** Pages through every fact so far; live facts merge in by seq meanwhile. */
  async load() {
    const sessionId = this.sessionId;
    const loading = readFacts(sessionId);
    this.loading = loading;
    try {
      const facts = await loading;
      if (this.sessionId !== sessionId) return;
      for (const fact of facts) this.add(fact);
      this.loaded = true;
      this.dirty = true;
      this.schedule();
    } catch (error) {
      if (this.sessionId === sessionId) this.reportError(error);
    } finally {
      if (this.loading === loading) this.loading = null;
    }
  }

  /** A fact from the live stream of the chat's session. */
  liveFact(sessionId, fact) {
    if (sessionId !== this.sessionId) this.reset(sessionId);
    this.add(fact);
    this.schedule();
  }

  add(fact) {
    if (!fact || !Number.isSafeInteger(fact.seq) || this.facts.has(fact.seq)) return;
    this.facts.set(fact.seq, { ...fact, data: fact.data || {} });
    this.dirty = true;
  }

  /** Renders once per frame at most, and only while visible. */
  schedule() {
    if (!this.visible || this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if (this.visible && (this.dirty || !this.timeline.firstChild)) this.render();
    });
  }

  render() {
    this.dirty = false;
    const facts = [...this.facts.values()].sort((a, b) => a.seq - b.seq);
    const model = buildTimeline(facts);
    const toolNames = new Map();
    for (const fact of facts) {
      for (const call of (fact.kind === "assistant" && fact.data.toolCalls) || []) toolNames.set(call.id, call.name);
    }
    const epochs = model.bands.filter((band) => band.start).length;
    const takeovers = model.bands.filter((band) => band.transition === "takeover").length;
    this.summary.replaceChildren(
      chip("facts", facts.length ? `#1–#${facts[facts.length - 1].seq}` : "none"),
      chip("epochs", epochs),
      h("span", { className: `chip${takeovers ? " chip-takeover" : ""}` }, h("span", { className: "chip-label" }, "takeovers"), ` ${takeovers}`),
      chip("compactions", model.compactions.length),
    );
    if (!this.loaded) this.summary.append(h("span", { className: "hint" }, "loading…"));
    const t = this.timeline;
    const stick = t.scrollHeight - t.scrollTop - t.clientHeight < 80;
    const scrollTop = t.scrollTop;
    t.replaceChildren(...model.bands.map((band) => this.renderBand(band, model, toolNames)));
    t.scrollTop = stick ? t.scrollHeight : scrollTop;
  }

  renderBand(band, model, toolNames) {
    const rows = band.facts.map((fact) => this.renderRow(fact, model, toolNames));
    if (!band.start) {
      return h(
        "section",
        { className: "epoch-band no-epoch", dataset: { epoch: "" } },
        h("header", { className: "band-header" }, h("span", { className: "band-title" }, "Before the first epoch")),
        rows,
      );
    }
    const chips = [
      chip("runtime", shortId(band.runtimeId), band.runtimeId),
      chip("attempt", shortId(band.attemptId, 9), band.attemptId),
    ];
    if (Number.isFinite(band.watermark)) chips.push(chip("watermark", `#${band.watermark}`));
    if (Number.isFinite(band.loadoutRevision)) chips.push(chip("loadout", `rev ${band.loadoutRevision}`));
    const header = h(
      "header",
      { className: "band-header" },
      h("span", { className: "band-title" }, `Epoch ${band.epoch}`),
      h("span", { className: `transition transition-${band.transition}` }, TRANSITIONS[band.transition]),
      h("span", { className: "chips" }, chips),
    );
    const children = [header];
    if (band.transition === "takeover") children.push(this.renderTakeover(band));
    children.push(...rows);
    return h(
      "section",
      {
        className: `epoch-band band-${band.epoch % 2 ? "odd" : "even"}${band.transition === "takeover" ? " takeover" : ""}`,
        dataset: { epoch: band.epoch, transition: band.transition },
      },
      children,
    );
  }

  renderTakeover(band) {
    const runtime =
      band.previousRuntimeId && band.previousRuntimeId !== band.runtimeId
        ? `runtime ${band.previousRuntimeId} → ${band.runtimeId}`
        : `same runtime ${band.runtimeId}`;
    return h(
      "div",
      { className: "takeover-mark", role: "note" },
      h(
        "div",
        {},
        h("strong", {}, "⚠ Takeover: "),
        `epoch ${band.previousEpoch} stopped with its work unfinished (a crash or a handoff)`,
      ),
      h("div", { className: "runtime-change" }, runtime),
      h("div", {}, `Redone from the ledger: ${describeOwed(band.owed)}`),
    );
  }

  renderRow(fact, model, toolNames) {
    const tags = [];
    const by = model.summarizedBy.get(fact.seq);
    if (by !== undefined) tags.push(h("span", { className: "tag tag-summarized" }, `summarized by #${by}`));
    const kept = model.firstKeptBy.get(fact.seq);
    if (kept !== undefined) tags.push(h("span", { className: "tag tag-kept" }, `first kept by #${kept}`));
    const action = [];
    if (fact.kind === "assistant" && generationHead(fact.data.generationId) !== null) {
      action.push(
        h(
          "button",
          { type: "button", className: "saw", onclick: () => this.openContext(fact) },
          "What the model saw",
        ),
      );
    }
    const classes = ["tl-row", `kind-${fact.kind}`];
    if (by !== undefined) classes.push("summarized");
    if (this.selected === fact.seq) classes.push("selected");
    return h(
      "div",
      { className: classes.join(" "), dataset: { seq: fact.seq, kind: fact.kind }, title: formatTime(fact.timestamp) },
      h("span", { className: "tl-seq" }, `#${fact.seq}`),
      h("span", { className: `badge badge-${fact.kind}` }, KIND_LABELS[fact.kind] || fact.kind),
      h("span", { className: "tl-text" }, describe(fact, toolNames)),
      h("span", { className: "tl-extras" }, tags, action),
      h("span", { className: "tl-time" }, formatClock(fact.timestamp)),
    );
  }

  /** Loads the request an answer was generated from: its gen-N is the context head. */
  async openContext(answer) {
    const at = generationHead(answer.data.generationId);
    this.selected = answer.seq;
    for (const row of this.timeline.querySelectorAll(".tl-row.selected")) row.classList.remove("selected");
    const row = this.timeline.querySelector(`.tl-row[data-seq="${answer.seq}"]`);
    if (row) row.classList.add("selected");
    const request = ++this.contextRequest;
    const sessionId = this.sessionId;
    this.panel.replaceChildren(h("p", { className: "hint" }, `Loading what the model saw at #${at}…`));
    try {
      const context = await api("GET", `${sessionPath(sessionId, "/context")}?at=${at}`);
      if (request !== this.contextRequest) return;
      this.panel.replaceChildren(renderContext(context, answer));
      this.panel.scrollTop = 0;
    } catch (error) {
      if (request !== this.contextRequest) return;
      this.panel.replaceChildren(h("p", { className: "hint error" }, `Could not load the context: ${error.message}`));
    }
  }
}
