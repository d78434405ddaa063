// Small DOM helpers. Everything from the server goes in as text nodes or attributes, never as
// HTML, so a trajectory that contains markup shows the markup instead of running it.

const SVG_NS = "http://www.w3.org/2000/svg";

export function h(tag, attrs = {}, ...children) {
  const el = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function fmt(v) {
  if (v == null) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

// A hash link: the whole UI is one page, so navigation never reloads it or re-asks for the key.
export function link(path, params, ...children) {
  return h("a", { href: "#" + route(path, params) }, ...children);
}

export function route(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v != null) q.set(k, v);
  const s = q.toString();
  return path + (s ? "?" + s : "");
}

export function kvTable(obj, cls = "kv") {
  const keys = Object.keys(obj || {}).sort();
  if (!keys.length) return h("p", { class: "muted" }, "none");
  return h("table", { class: cls }, h("tbody", {}, keys.map(k => h("tr", {}, h("th", {}, k), h("td", {}, display(obj[k]))))));
}

function display(v) {
  return v !== null && typeof v === "object" ? JSON.stringify(v) : fmt(v);
}

export function metaSummary(meta) {
  return Object.entries(meta || {}).map(([k, v]) => `${k}=${display(v)}`).join("  ");
}
