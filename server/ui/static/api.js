// The JSON API under /ui/api. With a server key, the key the user typed lives in sessionStorage
// (this tab only) and travels as a Bearer header, never in a URL.

const KEY = "artisan.apiKey";

export class AuthError extends Error {}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY),
  set: (k) => sessionStorage.setItem(KEY, k),
  clear: () => sessionStorage.removeItem(KEY),
};

export async function getJSON(path, params = {}) {
  const url = new URL("api/" + path, document.baseURI);
  for (const [k, v] of Object.entries(params)) if (v !== "" && v != null) url.searchParams.set(k, v);
  const headers = { Accept: "application/json" };
  const key = apiKey.get();
  if (key) headers.Authorization = "Bearer " + key;
  const resp = await fetch(url, { headers });
  const body = await resp.json().catch(() => null);
  if (resp.status === 401) throw new AuthError(body?.error?.message || "API key needed");
  if (!resp.ok) throw new Error(body?.error?.message || `${resp.status} ${resp.statusText}`);
  return body;
}
