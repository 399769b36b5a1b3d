// How the chat shows each committed fact.
"use strict";

import { asText, h } from "./dom.js";
import { thinkingBlock } from "./previews.js";

export const CANCELLED_STOP = "cancelled";

// Every committed fact kind the edge sends: the stream's named events that
// are facts (the others are partials and signals).
export const FACT_KINDS = [
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
  "approval_requested",
  "approval",
  "inputs_skipped",
  "forked_from",
];

/** `view` holds what rendering needs from the chat: toolNames (id -> name),
 *  inputs (seq -> element), approvals (toolCallId -> approval card), parked
 *  (the latest park's card, or null), onRetry(seq), onEdit(seq, text), onSkip() and
 *  onDecide(toolCallId, approve, note) -> Promise. */
export function renderFact(fact, view) {
  const data = fact.data;
  switch (fact.kind) {
    case "input":
      return renderInput(fact, view);
    case "assistant":
      return renderAssistant(fact, view);
    case "tool_result":
      return renderToolResult(data, view);
    case "compaction":
      return renderCompaction(data);
    case "session_created":
      return h("div", { className: "notice" }, "Session created");
    case "epoch_started":
      // Every claim starts an epoch; the inspector shows them, the chat
      // is about answers, not owners.
      return h("div", { className: "fact-hidden", hidden: true });
    case "attempt_failed": {
      const again = data.retryable ? " — retrying" : "";
      return h("div", { className: "notice warn" }, `Attempt failed: ${data.error}${again}`);
    }
    case "cancelled":
      return h("div", { className: "notice" }, "Cancel requested");
    case "session_parked":
      return renderParked(fact, view);
    case "forked_from":
      return h("div", { className: "notice" }, `Forked from ${String(data.sessionId).split(":").pop()} at #${data.seq}`);
    case "inputs_skipped":
      for (const seq of data.inputSeqs || []) view.inputs.get(seq)?.classList.add("skipped");
      return h(
        "div",
        { className: "notice" },
        `Skipped ${(data.inputSeqs || []).map((seq) => `#${seq}`).join(", ")}: ${data.reason}`,
      );
    case "compaction_failed":
      return h("div", { className: "notice warn" }, `Compaction failed: ${data.error}`);
    case "approval_requested":
      return renderApprovalRequest(fact, view);
    case "approval":
      return h(
        "div",
        { className: `notice ${data.approve ? "" : "warn"}`, dataset: { toolCallId: data.toolCallId } },
        decisionText(data, view),
      );
    default:
      return h("div", { className: "notice" }, `${fact.kind} fact`);
  }
}

function renderInput(fact, view) {
  const data = fact.data;
  const el = h(
    "div",
    { className: "bubble fact-input" },
    h(
      "div",
      { className: "meta" },
      h("span", {}, `#${fact.seq}`),
      data.retryOf ? h("span", {}, `retry of #${data.retryOf}`) : null,
      (data.blobs || []).length ? h("span", {}, `${data.blobs.length} attachment(s)`) : null,
      h("span", { className: "spacer" }),
      h(
        "button",
        { type: "button", className: "retry", title: "Ask this again", onclick: () => view.onRetry(fact.seq) },
        "Retry",
      ),
      h(
        "button",
        {
          type: "button",
          className: "edit",
          title: "Edit and resend, in a new session forked just before this message",
          onclick: () => view.onEdit(fact.seq, data.text),
        },
        "Edit",
      ),
    ),
    h("div", { className: "text" }, data.text),
  );
  view.inputs.set(fact.seq, el);
  return el;
}

function renderAssistant(fact, view) {
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
    view.toolNames.set(call.id, call.name);
    el.append(
      h(
        "div",
        { className: "tool-call", dataset: { toolCallId: call.id } },
        h("div", { className: "tool-name" }, `Tool call: ${call.name}`),
        h("pre", {}, asText(call.argumentsText ?? call.arguments ?? {})),
      ),
    );
  }
  return el;
}

/** A park: why, and the two ways on while it lasts: Retry asks the failed
 *  inputs again, Skip settles them (the model is told they were skipped)
 *  so the inputs sent since are answered. The buttons go once the session
 *  runs again (`settleParked`). */
function renderParked(fact, view) {
  const data = fact.data;
  const failed = data.inputSeqs || [];
  const named = failed.length ? ` on ${failed.map((seq) => `#${seq}`).join(", ")}` : "";
  const retry = h("button", { type: "button", className: "retry-parked" }, "Retry");
  const skip = h("button", { type: "button", className: "skip" }, "Skip");
  const actions = h("div", { className: "parked-actions" }, failed.length ? [retry, skip] : [retry]);
  const card = h(
    "div",
    { className: "notice error parked", dataset: { seq: String(fact.seq) } },
    h("div", {}, `Session parked${named}: ${data.reason}`),
    actions,
  );
  const act = async (work) => {
    retry.disabled = true;
    skip.disabled = true;
    try {
      await work();
    } finally {
      if (card.querySelector(".parked-actions")) {
        retry.disabled = false;
        skip.disabled = false;
      }
    }
  };
  retry.addEventListener("click", () =>
    act(async () => {
      // Without named inputs (an older park), the latest input is asked again.
      const seqs = failed.length ? failed : [Math.max(0, ...view.inputs.keys())];
      for (const seq of seqs) if (seq > 0) await view.onRetry(seq);
    }),
  );
  skip.addEventListener("click", () => act(() => view.onSkip()));
  view.parked = card;
  return card;
}

/** The park is over (its inputs skipped, or an attempt ran again). */
export function settleParked(view) {
  const card = view.parked;
  view.parked = null;
  card?.querySelector(".parked-actions")?.remove();
}

/** A call waiting for a person: its tool and arguments, a note, and the two
 *  buttons. The card stays in the transcript; once the call is decided (or
 *  closed by a result) its buttons go and it says what happened. */
function renderApprovalRequest(fact, view) {
  const data = fact.data;
  const note = h("input", {
    type: "text",
    className: "approval-note",
    placeholder: "Note (optional)",
    "aria-label": "Note",
    maxlength: "4096",
  });
  const approve = h("button", { type: "button", className: "approve" }, "Approve");
  const deny = h("button", { type: "button", className: "deny" }, "Deny");
  const actions = h("div", { className: "approval-actions" }, note, approve, deny);
  const card = h(
    "div",
    { className: "bubble approval pending", dataset: { toolCallId: data.toolCallId } },
    h(
      "div",
      { className: "meta" },
      h("span", {}, `#${fact.seq}`),
      h("span", { className: "approval-state" }, "waiting for approval"),
    ),
    h("div", { className: "tool-name" }, `${data.name} wants to run`),
    h("pre", {}, asText(data.arguments || {})),
    actions,
  );
  const decide = async (yes) => {
    approve.disabled = true;
    deny.disabled = true;
    try {
      await view.onDecide(data.toolCallId, yes, note.value.trim());
    } finally {
      // Re-enabled only if the call still waits (the POST failed).
      if (card.classList.contains("pending")) {
        approve.disabled = false;
        deny.disabled = false;
      }
    }
  };
  approve.addEventListener("click", () => decide(true));
  deny.addEventListener("click", () => decide(false));
  view.approvals.set(data.toolCallId, card);
  return card;
}

/** One line saying how a waiting call was decided. */
function decisionText(data, view) {
  const name = view.toolNames.get(data.toolCallId) || data.toolCallId;
  const said = data.note ? `: ${data.note}` : "";
  return `${data.approve ? "Approved" : "Denied"} ${name} (by ${data.by})${said}`;
}

/** Marks a waiting call's card settled (`outcome`: approved, denied, or
 *  closed by a result without a decision); the decision's own fact says
 *  who decided and why. */
export function settleApproval(view, toolCallId, outcome) {
  const card = view.approvals.get(toolCallId);
  if (!card || !card.classList.contains("pending")) return;
  card.classList.remove("pending");
  card.dataset.outcome = outcome;
  card.querySelector(".approval-actions").remove();
  card.querySelector(".approval-state").textContent = outcome;
}

/** How many calls on screen still wait for a decision. */
export function pendingApprovals(view) {
  let count = 0;
  for (const card of view.approvals.values()) if (card.classList.contains("pending")) count += 1;
  return count;
}

function renderToolResult(data, view) {
  const name = view.toolNames.get(data.toolCallId) || data.toolCallId;
  return h(
    "div",
    { className: `bubble fact-tool_result${data.isError ? " error" : ""}`, dataset: { toolCallId: data.toolCallId } },
    h("div", { className: "meta" }, `${name} ${data.isError ? "failed" : "returned"}`),
    h("pre", {}, asText(data.content)),
  );
}

export function compactionHeadline(data) {
  const before = data.tokensBefore;
  const after = data.tokensAfter;
  let headline = "Context compacted";
  if (Number.isFinite(before) && Number.isFinite(after)) headline += `: ${before} → ${after} tokens`;
  else if (Number.isFinite(before)) headline += `: ${before} tokens summarized`;
  const range = Array.isArray(data.summarized) && data.summarized.length === 2 ? data.summarized : null;
  if (range) headline += ` (facts #${range[0]}–#${range[1]})`;
  return headline;
}

function renderCompaction(data) {
  return h(
    "details",
    { className: "maintenance" },
    h("summary", {}, compactionHeadline(data)),
    h("pre", {}, data.summary || ""),
  );
}
