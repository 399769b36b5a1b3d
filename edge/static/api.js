// The edge's HTTP API, as the page uses it. Paths are relative so the page
// also works behind a proxy that mounts the edge under a prefix.
"use strict";

const KEY_STORAGE = "keel.apiKey";

let apiKey = "";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function currentKey() {
  return apiKey;
}

export function storeKey(key) {
  apiKey = key;
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function storedKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

/** One JSON request; an error answer becomes an ApiError with its code. */
export async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${apiKey}` };
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

export function sessionPath(id, suffix = "") {
  return `v1/sessions/${encodeURIComponent(id)}${suffix}`;
}

/** Every committed fact of a session after `after`, page by page. */
export async function readFacts(sessionId, after = 0, limit = 500) {
  const facts = [];
  let cursor = after;
  for (;;) {
    const params = new URLSearchParams({ format: "json", after: String(cursor), limit: String(limit) });
    const page = await api("GET", `${sessionPath(sessionId, "/events")}?${params}`);
    facts.push(...(page.facts || []));
    if (!page.facts || page.facts.length === 0 || page.next >= page.headSeq) return facts;
    cursor = page.next;
  }
}
