// Token partials ("delta" events) as disposable previews.
//
// A preview belongs to one generation as streamed by one attempt: the key is
// (generationId, epoch, attemptId). A successor (a new epoch after a crash or
// a handoff) and a retried attempt stream the same generationId again from
// the first token, so a delta under another (epoch, attemptId) replaces the
// preview instead of being glued onto it. The committed `assistant` fact
// with that generationId ends the preview for good.
"use strict";

import { h } from "./dom.js";

/** Collapsed: thinking is there to inspect, not to read by default. */
export function thinkingBlock(label, pre) {
  return h("details", { className: "thinking" }, h("summary", {}, label), pre);
}

function sameAttempt(preview, delta) {
  return preview.epoch === delta.epoch && preview.attemptId === delta.attemptId;
}

/** One bubble: a part per channel, one box per tool call. */
class Preview {
  constructor(delta) {
    this.generationId = delta.generationId;
    this.epoch = delta.epoch;
    this.attemptId = delta.attemptId;
    this.text = h("div", { className: "text" });
    this.thinking = null;
    this.toolCalls = new Map();
    this.el = h(
      "div",
      {
        className: "bubble pending-assistant",
        dataset: {
          generationId: delta.generationId,
          epoch: delta.epoch ?? "",
          attemptId: delta.attemptId ?? "",
        },
      },
      h("div", { className: "meta" }, "answering…"),
      this.text,
    );
  }

  append(delta) {
    if (delta.channel === "thinking") {
      if (!this.thinking) {
        this.thinking = h("pre");
        this.el.insertBefore(thinkingBlock("Thinking…", this.thinking), this.text);
      }
      this.thinking.append(delta.text);
    } else if (delta.channel === "tool_call") {
      this.toolCall(delta).append(delta.text);
    } else {
      this.text.append(delta.text);
    }
  }

  /** Fragments of one tool call's arguments go into that call's box. */
  toolCall(delta) {
    const id = delta.toolCallId || "";
    let call = this.toolCalls.get(id);
    if (!call) {
      const name = h("div", { className: "tool-name" });
      const args = h("pre");
      this.el.append(h("div", { className: "tool-call", dataset: { toolCallId: id } }, name, args));
      call = { name, args };
      this.toolCalls.set(id, call);
    }
    if (delta.toolName) call.name.textContent = `Tool call: ${delta.toolName}`;
    else if (!call.name.textContent) call.name.textContent = "Tool call";
    return call.args;
  }
}

export class Previews {
  /** `container` holds the bubbles, below every committed fact. */
  constructor(container) {
    this.container = container;
    this.byGeneration = new Map();
    // generationIds whose assistant fact is rendered: a late delta for one
    // of them must not open a new preview under the final answer.
    this.committed = new Set();
  }

  clear() {
    this.drop();
    this.committed.clear();
  }

  /** Applies one delta (I2 shape); returns false when it was ignored. */
  delta(delta) {
    const id = delta.generationId;
    if (!id || typeof delta.text !== "string" || this.committed.has(id)) return false;
    let preview = this.byGeneration.get(id);
    if (preview && !sameAttempt(preview, delta)) {
      // A late token of an older epoch must not wipe out its successor.
      if (Number.isFinite(preview.epoch) && Number.isFinite(delta.epoch) && delta.epoch < preview.epoch) {
        return false;
      }
      this.remove(id);
      preview = undefined;
    }
    if (!preview) {
      preview = new Preview(delta);
      this.byGeneration.set(id, preview);
      this.container.append(preview.el);
    }
    preview.append(delta);
    return true;
  }

  /** The answer committed: its preview is moot from now on. */
  commit(generationId) {
    this.committed.add(generationId);
    this.remove(generationId);
  }

  remove(generationId) {
    const preview = this.byGeneration.get(generationId);
    if (preview) preview.el.remove();
    this.byGeneration.delete(generationId);
  }

  /** Drops previews streamed by an epoch older than `epoch` (they were cut off). */
  dropOlderThan(epoch) {
    for (const [id, preview] of [...this.byGeneration]) {
      if (!Number.isFinite(preview.epoch) || preview.epoch < epoch) this.remove(id);
    }
  }

  /** Drops previews of `epoch` and older (that attempt failed); all without one. */
  dropUpTo(epoch) {
    if (!Number.isFinite(epoch)) return this.drop();
    this.dropOlderThan(epoch + 1);
  }

  drop() {
    for (const id of [...this.byGeneration.keys()]) this.remove(id);
  }
}
