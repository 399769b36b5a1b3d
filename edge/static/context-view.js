// "What the model saw": the system prompt and messages a request presented,
// from GET /v1/sessions/{id}/context?at=N, as readable bubbles.
"use strict";

import { asText, h } from "./dom.js";

// The wrapper the compaction policy puts around a summary (compaction/policy/context.py).
const SUMMARY_INTRO = "The conversation history before this point was compacted";

const ROLE_LABELS = { user: "user", assistant: "assistant", toolResult: "tool result", system: "system" };

function chip(label, value) {
  return h("span", { className: "chip" }, h("span", { className: "chip-label" }, label), ` ${value}`);
}

/** One content part: text, thinking, a tool call, an image, or anything else as JSON. */
function renderPart(part) {
  if (typeof part === "string") return h("div", { className: "text" }, part);
  switch (part && part.type) {
    case "text":
      return h("div", { className: "text" }, part.text ?? "");
    case "thinking":
      return h(
        "details",
        { className: "thinking" },
        h("summary", {}, "Thinking"),
        h("pre", {}, part.thinking ?? ""),
      );
    case "toolCall":
      return h(
        "div",
        { className: "tool-call" },
        h("div", { className: "tool-name" }, `Tool call: ${part.name}`),
        h("pre", {}, asText(part.arguments || {})),
      );
    case "image": {
      const mime = /^image\/[\w.+-]+$/.test(part.mimeType || "") ? part.mimeType : "application/octet-stream";
      return h(
        "figure",
        { className: "blob-image" },
        h("img", { src: `data:${mime};base64,${part.data || ""}`, alt: `image (${mime})` }),
        h("figcaption", {}, `image · ${mime}`),
      );
    }
    default:
      return h("pre", { className: "blob-other" }, asText(part));
  }
}

function renderContent(content) {
  if (typeof content === "string") return [h("div", { className: "text" }, content)];
  if (!Array.isArray(content)) return [h("pre", {}, asText(content))];
  // An input with blobs: its text first, then each blob as its own part.
  return content.map((part, index) => {
    const el = renderPart(part);
    if (index > 0 && part && part.type === "text") el.classList.add("blob-text");
    return el;
  });
}

function isSummary(message) {
  return message.role === "user" && typeof message.content === "string" && message.content.startsWith(SUMMARY_INTRO);
}

function renderMessage(message, index, compactionSeq) {
  const role = message.role || "?";
  const summary = isSummary(message);
  const label = summary ? `compaction summary${compactionSeq ? ` (#${compactionSeq})` : ""}` : ROLE_LABELS[role] || role;
  const meta = [h("span", { className: "role" }, label), h("span", {}, `message ${index + 1}`)];
  if (role === "toolResult") {
    meta.push(h("span", {}, message.toolName || message.toolCallId || ""));
    if (message.isError) meta.push(h("span", { className: "error-word" }, "error"));
  }
  const parts = (Array.isArray(message.content) ? message.content : []).filter(
    (part) => part && part.type === "image",
  ).length;
  if (parts) meta.push(h("span", {}, `${parts} image(s)`));
  return h(
    "div",
    {
      className: `bubble ctx-message ctx-${summary ? "summary" : role}`,
      dataset: { role: summary ? "summary" : role },
    },
    h("div", { className: "meta" }, meta),
    renderContent(message.content),
  );
}

/** The panel body for one answer; `answer` is the assistant fact. */
export function renderContext(context, answer) {
  const chips = [chip("context at", `#${context.at}`)];
  if (Number.isFinite(context.watermark)) chips.push(chip("watermark", `#${context.watermark}`));
  if (Number.isFinite(context.loadoutRevision)) chips.push(chip("loadout", `rev ${context.loadoutRevision}`));
  chips.push(chip("compaction", context.compactionSeq ? `#${context.compactionSeq}` : "none"));
  const messages = context.messages || [];
  chips.push(chip("messages", messages.length));
  const system = context.systemPrompt || "";
  return h(
    "div",
    { className: "ctx-body" },
    h("h3", {}, `What the model saw for answer #${answer.seq}`),
    h("div", { className: "chips" }, chips),
    h(
      "div",
      { className: "bubble ctx-message ctx-system", dataset: { role: "system" } },
      h("div", { className: "meta" }, h("span", { className: "role" }, "system prompt")),
      system ? h("div", { className: "text" }, system) : h("div", { className: "text empty" }, "(no system prompt)"),
    ),
    messages.map((message, index) => renderMessage(message, index, context.compactionSeq)),
  );
}
