// A session's facts as the inspector reads them: epoch bands, how each epoch
// began (first claim, next claim, retry, takeover) and what each compaction
// summarized. Pure functions over the facts, so every view of the same
// facts tells the same story.
//
// A takeover is an epoch whose predecessor stopped with its work unfinished:
// inputs up to its watermark still unanswered, or tool calls of the latest
// answer still without a result. That is what a crash or a handoff leaves
// behind, and exactly what the successor has to redo from the ledger. An
// epoch after a failed attempt is a retry; any other epoch is an ordinary
// claim of new work. A call that waited for a person's decision is not
// unfinished work: the epoch its decision wakes is new work.
"use strict";

export const TRANSITIONS = {
  first: "first claim",
  next: "new work",
  retry: "retry after a failure",
  takeover: "takeover",
};

/** What the latest owner still owed when the next epoch started. */
class Ledger {
  constructor() {
    this.inputs = [];
    this.consumed = new Set();
    this.results = new Set();
    // Calls that waited for a decision (approval_requested): not owed.
    this.asked = new Set();
    this.latestAnswer = null;
  }

  add(fact) {
    const data = fact.data || {};
    if (fact.kind === "input") this.inputs.push(fact.seq);
    else if (fact.kind === "assistant") {
      for (const seq of data.inputSeqs || []) this.consumed.add(seq);
      this.latestAnswer = fact;
    } else if (fact.kind === "tool_result") this.results.add(data.toolCallId);
    else if (fact.kind === "approval_requested") this.asked.add(data.toolCallId);
  }

  owed(watermark) {
    const inputs = this.inputs.filter((seq) => seq <= watermark && !this.consumed.has(seq));
    const calls = ((this.latestAnswer && this.latestAnswer.data.toolCalls) || []).filter(
      (call) => !this.results.has(call.id) && !this.asked.has(call.id),
    );
    return { inputs, calls };
  }
}

function newBand(start, previous, transition, owed) {
  const data = start ? start.data || {} : {};
  return {
    epoch: start ? data.epoch : null,
    start,
    runtimeId: data.runtimeId || "",
    attemptId: data.attemptId || "",
    watermark: data.watermark,
    loadoutRevision: data.loadoutRevision,
    previousEpoch: previous ? previous.epoch : null,
    previousRuntimeId: previous ? previous.runtimeId : "",
    transition,
    owed,
    facts: [],
  };
}

/** The kinds only an epoch's owner writes (client facts arrive any time). */
const RUNNER_KINDS = new Set([
  "assistant",
  "tool_result",
  "compaction",
  "attempt_failed",
  "session_parked",
  "compaction_failed",
  "approval_requested",
]);

/** `facts` in seq order -> { bands, compactions, summarizedBy, firstKeptBy }. */
export function buildTimeline(facts) {
  const ledger = new Ledger();
  const bands = [];
  let band = newBand(null, null, null, null);
  let lastRunnerKind = null;
  const compactions = [];
  for (const fact of facts) {
    if (fact.kind === "epoch_started") {
      const previous = band.start ? band : null;
      let transition = "first";
      let owed = null;
      if (previous) {
        owed = ledger.owed(previous.watermark ?? 0);
        if (lastRunnerKind === "attempt_failed") transition = "retry";
        else if (owed.inputs.length || owed.calls.length) transition = "takeover";
        else transition = "next";
      }
      if (band.facts.length || band.start) bands.push(band);
      band = newBand(fact, previous, transition, owed);
      lastRunnerKind = null;
    } else if (RUNNER_KINDS.has(fact.kind)) {
      lastRunnerKind = fact.kind;
    }
    ledger.add(fact);
    band.facts.push(fact);
    if (fact.kind === "compaction") compactions.push(compactionOf(fact));
  }
  if (band.facts.length || band.start) bands.push(band);

  // Only facts a request is built from can be summarized (not bookkeeping).
  const contextKinds = new Set(["input", "assistant", "tool_result", "compaction"]);
  const summarizedBy = new Map();
  const firstKeptBy = new Map();
  for (const compaction of compactions) {
    if (compaction.from !== null) {
      for (const fact of facts) {
        const inRange = fact.seq >= compaction.from && fact.seq <= compaction.to;
        if (inRange && contextKinds.has(fact.kind)) summarizedBy.set(fact.seq, compaction.seq);
      }
    }
    if (compaction.firstKept !== null) firstKeptBy.set(compaction.firstKept, compaction.seq);
  }
  return { bands, compactions, summarizedBy, firstKeptBy };
}

function compactionOf(fact) {
  const data = fact.data || {};
  const range = Array.isArray(data.summarized) && data.summarized.length === 2 ? data.summarized : null;
  return {
    seq: fact.seq,
    from: range ? Number(range[0]) : null,
    to: range ? Number(range[1]) : null,
    firstKept: Number.isFinite(data.firstKept) ? data.firstKept : null,
  };
}

/** "input #3, tool call clock" — what a takeover had to redo. */
export function describeOwed(owed) {
  if (!owed) return "";
  const parts = [];
  if (owed.inputs.length) parts.push(`${owed.inputs.length === 1 ? "input" : "inputs"} ${owed.inputs.map((s) => `#${s}`).join(", ")}`);
  for (const call of owed.calls) parts.push(`tool call ${call.name}`);
  return parts.join(", ");
}
