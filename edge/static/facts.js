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
];

/** `view` holds what rendering needs from the chat: toolNames (id -> name),
 *  inputs (seq -> element) and onRetry(seq). */
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
      return h("div", { className: "notice error" }, `Session parked: ${data.reason}`);
    case "compaction_failed":
      return h("div", { className: "notice warn" }, `Compaction failed: ${data.error}`);
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
        h("pre", {}, asText(call.arguments || {})),
      ),
    );
  }
  return el;
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
