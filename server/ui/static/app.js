// Hash routing: #/ runs, #/run/NAME, #/run/NAME/step/N, #/run/NAME/step/N/group/G, #/traj/ID.
// The query after `?` carries filters and the split, so a filtered view is a link one can share.
import { AuthError, apiKey } from "./api.js";
import { h, link } from "./dom.js";
import { groupView, runView, runsView, stepView, trajectoryView } from "./views.js";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const forget = document.getElementById("forget-key");

const ROUTES = [
  [/^\/?$/, () => runsView(), "runs"],
  [/^\/run\/([^/]+)$/, (m, q) => runView(m[1], q), "run"],
  [/^\/run\/([^/]+)\/step\/(\d+)$/, (m, q) => stepView(m[1], m[2], q), "step"],
  [/^\/run\/([^/]+)\/step\/(\d+)\/group\/(\d+)$/, (m, q) => groupView(m[1], m[2], m[3], q), "group"],
  [/^\/traj\/(\d+)$/, m => trajectoryView(m[1]), "trajectory"],
];

let rendering = 0;  // a slow response for a page already left must not overwrite the current one

async function render() {
  const ticket = ++rendering;
  const hash = location.hash;
  const [path, qs = ""] = hash.replace(/^#/, "").split("?");
  const query = new URLSearchParams(qs);
  document.body.dataset.ready = "";
  forget.hidden = !apiKey.get();
  const found = ROUTES.map(([re, view, name]) => [path.match(re), view, name]).find(([m]) => m);
  try {
    if (!found) throw new Error(`no page at ${path}`);
    const [m, view, name] = found;
    const page = await view([...m].map(s => s && decodeURIComponent(s)), query);
    if (ticket !== rendering) return;
    document.title = `${page.title} · artisan`;
    crumbs.replaceChildren(...page.crumbs.flatMap(([label, target]) =>
      [h("span", { class: "sep" }, "/"), target ? link(target, {}, label) : h("span", {}, label)]));
    main.replaceChildren(page.node);
    done(name, hash);
  } catch (err) {
    if (ticket !== rendering) return;
    if (err instanceof AuthError) return askForKey(err.message);
    main.replaceChildren(h("p", { class: "error" }, String(err.message || err)));
    done("error", hash);
  }
}

// Which page is on screen and for which URL: lets a script (the browser tests) wait for the page
// to catch up with a hash it just set.
function done(view, hash) {
  document.body.dataset.ready = view;
  document.body.dataset.hash = hash;
}

function askForKey(message) {
  const hadKey = !!apiKey.get();
  apiKey.clear();
  const input = h("input", { type: "password", name: "key", autocomplete: "off", required: true, autofocus: true });
  const form = h("form", { id: "key-form", class: "key-form" },
    h("h1", {}, "API key"),
    h("p", { class: "muted" }, hadKey ? `The key was refused (${message}).` :
      "This server needs its API key. It stays in this tab (sessionStorage) and is sent as a Bearer header."),
    input, h("button", { type: "submit" }, "open"));
  form.addEventListener("submit", ev => {
    ev.preventDefault();
    apiKey.set(input.value.trim());
    render();
  });
  crumbs.replaceChildren();
  main.replaceChildren(form);
  done("key", location.hash);
  input.focus();
}

forget.addEventListener("click", () => { apiKey.clear(); render(); });
window.addEventListener("hashchange", render);
render();
