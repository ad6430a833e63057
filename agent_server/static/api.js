// Talking to the server: the API key (kept in localStorage, asked for on a 401) and the
// Responses API's server-sent events read from a fetch() body.

const KEY_STORAGE = "oss-agent.api-key";

export class ApiClient {
  /** askForKey(message) -> Promise<string|null>: shown when the server answers 401. */
  constructor(askForKey) {
    this.askForKey = askForKey;
  }

  get key() {
    return localStorage.getItem(KEY_STORAGE) || "";
  }

  set key(value) {
    if (value) localStorage.setItem(KEY_STORAGE, value);
    else localStorage.removeItem(KEY_STORAGE);
  }

  /** fetch() with the key; a 401 asks for a (new) key and tries again until the user cancels. */
  async fetch(path, init = {}) {
    for (;;) {
      const headers = new Headers(init.headers || {});
      if (this.key) headers.set("Authorization", `Bearer ${this.key}`);
      const response = await fetch(path, { ...init, headers });
      if (response.status !== 401) return response;
      const message = await errorMessage(response);
      const key = await this.askForKey(this.key ? `The server refused this key: ${message}` : message);
      if (key === null) return null;
      this.key = key;
    }
  }
}

/** The message of an OpenAI-style error body, or the status line. */
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    // not JSON
  }
  return `${response.status} ${response.statusText}`;
}

/** Yield each parsed `data:` payload of an SSE stream (comments and pings are skipped). */
export async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let boundary;
      while ((boundary = buffer.search(/\r?\n\r?\n/)) !== -1) {
        const block = buffer.slice(0, boundary);
        buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, "");
        const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (data && data !== "[DONE]") yield JSON.parse(data);
      }
    }
  } finally {
    // Left early (the response ended, or the page stopped reading): let the connection go.
    await reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}
