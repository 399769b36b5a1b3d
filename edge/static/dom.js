// Small DOM and formatting helpers shared by the chat and the inspector.
"use strict";

/** Builds an element. Text always goes through textContent (no HTML injection). */
export function h(tag, attrs = {}, ...children) {
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

export const $ = (selector) => document.querySelector(selector);

/** crypto.randomUUID exists only in secure contexts; plain http on a LAN
 *  address is not one, so fall back to getRandomValues (available everywhere). */
export function newRequestId() {
  if (typeof crypto.randomUUID === "function") return crypto.randomUUID();
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  bytes[6] = (bytes[6] & 0x0f) | 0x40;
  bytes[8] = (bytes[8] & 0x3f) | 0x80;
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

export function formatTime(timestamp) {
  if (timestamp === undefined || timestamp === null) return undefined;
  const date = new Date(timestamp);
  return Number.isNaN(date.getTime()) ? undefined : date.toLocaleString();
}

export function formatClock(timestamp) {
  if (timestamp === undefined || timestamp === null) return "";
  const date = new Date(timestamp);
  return Number.isNaN(date.getTime()) ? "" : date.toLocaleTimeString();
}

export function asText(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

/** The first line of a text, cut to `limit` characters, for one-line rows. */
export function oneLine(text, limit = 120) {
  const flat = String(text ?? "").replace(/\s+/g, " ").trim();
  return flat.length > limit ? `${flat.slice(0, limit - 1)}…` : flat;
}

/** The N of a generation id `gen-N`: the context head its request was built at. */
export function generationHead(generationId) {
  const match = /^gen-(\d+)$/.exec(String(generationId ?? ""));
  return match ? Number(match[1]) : null;
}

/** The hash carries `key=` (from the link `keel up` prints), `session=` and
 *  `view=`. Parsed by hand: URLSearchParams would turn a "+" in a key into a space. */
export function readHash() {
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

/** Keeps only the session and the view in the address bar: the key must not
 *  linger in the URL (history, screenshots, shared links); localStorage holds it. */
export function writeHash(sessionId, view) {
  const parts = [];
  if (sessionId) parts.push(`session=${encodeURIComponent(sessionId)}`);
  if (sessionId && view && view !== "chat") parts.push(`view=${encodeURIComponent(view)}`);
  const hash = parts.length ? `#${parts.join("&")}` : "";
  history.replaceState(null, "", `${location.pathname}${location.search}${hash}`);
}
