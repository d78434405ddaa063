// The pages: runs, a run, a step's groups, a group side by side, one trajectory.
// Each view fetches what it shows and returns {title, crumbs, node}.
import { getJSON } from "./api.js";
import { chat, legend } from "./chat.js";
import { h, fmt, link, route, kvTable, metaSummary } from "./dom.js";
import { linePlot } from "./plot.js";

const enc = encodeURIComponent;

// The figures that say whether training can be working (DESIGN.md, invariant 8).
const HEALTH = [
  ["logprob_gap", "sampler–trainer logprob gap"], ["lora_update_norm", "LoRA update norm"],
  ["entropy", "entropy"], ["clip_fraction", "clip fraction"], ["grad_norm", "grad norm"],
  ["kl_to_base", "KL to base"], ["trainable_tokens", "trainable tokens"],
  ["groups_dropped_constant", "groups dropped (constant reward)"], ["reward_std", "reward std"],
  ["loss", "loss"], ["truncated_fraction", "truncated fraction"], ["prompt_mismatches", "prompt mismatches"],
  ["staleness_mean", "staleness, mean (steps behind)"], ["staleness_max", "staleness, max (steps behind)"],
  ["groups_dropped_stale", "groups dropped (staler than the bound)"],
  ["value_mean", "given value V*, mean (A*-PO)"], ["advantage_mean", "advantage, mean"],
  ["advantage_positive_fraction", "advantages > 0, fraction"],
];
const FILTERS = ["step", "split", "min_reward", "max_reward", "meta_key", "meta_value", "q"];

export async function runsView() {
  const { data } = await getJSON("runs");
  const rows = data.map(r => h("tr", { "data-run": r.name },
    h("td", {}, link(`/run/${enc(r.name)}`, {}, r.name)), h("td", {}, r.project), h("td", { class: "num" }, fmt(r.step)),
    h("td", { class: "num" }, fmt(r.last_reward)), h("td", { class: "num" }, fmt(r.last_eval_reward))));
  const node = h("section", {}, h("h1", {}, "Runs"),
    data.length ? h("table", { id: "runs", class: "grid" },
      h("thead", {}, h("tr", {}, ["run", "project", "step", "last reward", "last eval reward"].map(t => h("th", {}, t)))),
      h("tbody", {}, rows))
    : h("p", { class: "muted" }, "No runs yet: register one with TrainableModel(...).register(server_url)."));
  return { title: "runs", crumbs: [], node };
}

export async function runView(name, query) {
  const [run, attempts] = await Promise.all([getJSON(`runs/${enc(name)}`), getJSON(`runs/${enc(name)}/attempts`)]);
  const filters = Object.fromEntries(FILTERS.map(k => [k, query.get(k) ?? ""]));
  const points = split => (run.rewards[split] || []).map(p => ({ x: p.step, y: p.reward_mean }));
  const metric = key => run.steps.map(s => ({ x: s.step, y: s.metrics[key] }));
  const node = h("section", {},
    h("h1", {}, run.name),
    h("p", { class: "muted" }, `project ${run.project} · ${servingText(run)}`),
    bestHeldOut(run.best_held_out),
    h("h2", {}, "Reward"),
    h("div", { class: "plots wide" },
      linePlot("mean reward per step", [{ name: "train", points: points("train") }, { name: "eval (val)", points: points("val") }],
               { metric: "reward", width: 720, height: 260 })),
    h("h2", {}, "Step attempts"), attemptsTable(run.name, attempts.data),
    h("h2", {}, "Training health"),
    h("div", { class: "plots" }, HEALTH.map(([key, label]) => linePlot(label, [{ name: key, points: metric(key) }], { metric: key }))),
    domainPlots(run.steps),
    h("h2", {}, "Steps"), stepsTable(run),
    h("h2", {}, "Trajectories"), filterForm(run, filters), await trajectoryList(run.name, filters));
  return { title: run.name, crumbs: [[run.name, `/run/${enc(run.name)}`]], node };
}

// The bare name serves the latest step unless an earlier one is pinned (--keep-best).
function servingText(run) {
  const serving = run.serving_step ?? run.step;
  return serving === run.step || run.step == null ? `serving step ${fmt(serving)}`
    : `serving step ${fmt(serving)} (pinned; latest step ${fmt(run.step)}, served as ${run.name}@${run.step})`;
}

// The evaluated step with the highest held-out ("val") reward: the one to serve if later steps fell.
function bestHeldOut(best) {
  if (!best) return null;
  return h("p", { id: "best-held-out" }, `best held-out step: ${best.step} (reward ${fmt(best.reward)}, ${best.n} tasks)`);
}

// A run over several task families (tau2-bench's domains): each figure of the step's `domains`
// (protocol/domains.py) as one plot with a line per domain.
function domainPlots(steps) {
  const names = [...new Set(steps.flatMap(s => Object.keys(s.metrics.domains || {})))].sort();
  if (!names.length) return null;
  const keys = [...new Set(steps.flatMap(s => Object.values(s.metrics.domains || {}).flatMap(Object.keys)))].sort();
  const series = key => names.map(d => ({ name: d, points: steps.map(s => ({ x: s.step, y: s.metrics.domains?.[d]?.[key] })) }));
  return h("section", { id: "domains" }, h("h2", {}, `By domain (${names.join(", ")})`),
    h("div", { class: "plots" }, keys.map(key => linePlot(key, series(key), { metric: `domains.${key}` }))));
}

function stepsTable(run) {
  const byStep = new Map(run.steps.map(s => [s.step, s]));
  const splitsAt = new Map();
  for (const [split, pts] of Object.entries(run.rewards)) {
    for (const p of pts) splitsAt.set(p.step, [...(splitsAt.get(p.step) || []), split]);
  }
  const steps = [...new Set([...byStep.keys(), ...splitsAt.keys()])].sort((a, b) => b - a);
  if (!steps.length) return h("p", { class: "muted" }, "No steps yet.");
  return h("table", { id: "steps", class: "grid" },
    h("thead", {}, h("tr", {}, ["step", "kind", "reward mean", "groups trainable / total", "trainable tokens", "warnings", "groups"].map(t => h("th", {}, t)))),
    h("tbody", {}, steps.map(step => {
      const s = byStep.get(step), m = s?.metrics || {};
      return h("tr", { "data-step": step },
        h("td", { class: "num" }, step), h("td", {}, s?.kind ?? "logged"), h("td", { class: "num" }, fmt(m.reward_mean)),
        h("td", { class: "num" }, s ? `${fmt(m.groups_trainable)} / ${fmt(m.groups_total)}` : "–"),
        h("td", { class: "num" }, fmt(m.trainable_tokens)),
        h("td", {}, s?.warnings?.length ? h("ul", { class: "warnings" }, s.warnings.map(w => h("li", {}, w))) : ""),
        h("td", {}, (splitsAt.get(step) || []).map(split => link(`/run/${enc(run.name)}/step/${step}`, { split }, split))));
    })));
}

// How an attempt ended, in words; only "trained" moved the run.
const OUTCOMES = {
  trained: "trained", untrained: "nothing trained", failed: "failed, rolled back", cancelled: "cancelled",
  interrupted: "interrupted (server stopped)",
};

// Every try at a step, trained or not: a run whose reward stays flat shows here which attempts
// trained nothing and their warnings say why.
function attemptsTable(name, attempts) {
  if (!attempts.length) return h("p", { class: "muted" }, "No training jobs yet.");
  const idle = attempts.filter(a => !a.trained && !a.pending).length;
  const summary = idle
    ? h("p", { id: "attempts-summary", class: "attention" },
        `${idle} of ${attempts.length} step attempts trained nothing; their warnings say why.`)
    : h("p", { id: "attempts-summary", class: "muted" }, `${attempts.length} step attempts, all trained.`);
  const table = h("table", { id: "attempts", class: "grid" },
    h("thead", {}, h("tr", {}, ["attempt", "step", "kind", "outcome", "reward mean", "groups trainable / total",
                                "trainable tokens", "warnings", "job", "when"].map(t => h("th", {}, t)))),
    h("tbody", {}, [...attempts].reverse().map(a => {
      const m = a.metrics || {};
      const outcome = a.pending ? "committing" : a.outcome;
      return h("tr", { "data-attempt": a.attempt, "data-trained": String(a.trained), "data-outcome": outcome,
                       class: a.trained ? "trained" : "untrained" },
        h("td", { class: "num" }, a.attempt),
        h("td", { class: "num" }, a.trained ? link(`/run/${enc(name)}/step/${a.step}`, { split: "train" }, a.step)
                                            : h("span", { class: "muted", title: "the step it would have been" }, `(${a.step})`)),
        h("td", {}, a.kind),
        h("td", {}, h("span", { class: `outcome ${a.trained ? "ok" : "no"}` }, OUTCOMES[outcome] ?? outcome)),
        h("td", { class: "num" }, fmt(m.reward_mean)),
        h("td", { class: "num" }, m.groups_total != null ? `${fmt(m.groups_trainable)} / ${fmt(m.groups_total)}` : "–"),
        h("td", { class: "num" }, fmt(m.trainable_tokens)),
        h("td", {}, a.warnings.length ? h("ul", { class: "warnings" }, a.warnings.map(w => h("li", {}, w))) : ""),
        h("td", { class: "meta" }, a.job_id ?? "–"),
        h("td", { class: "meta" }, new Date(a.created * 1000).toLocaleString()));
    })));
  return h("div", {}, summary, table);
}

function filterForm(run, f) {
  const splits = Object.keys(run.rewards);
  const input = (name, label, attrs = {}) =>
    h("label", {}, label, h("input", { name, value: f[name], ...attrs }));
  const meta = f.meta_key ? `${f.meta_key}=${f.meta_value}` : "";
  const form = h("form", { id: "filters", class: "filters" },
    input("step", "step", { type: "number", min: 0, step: 1 }),
    h("label", {}, "split", h("select", { name: "split" }, h("option", { value: "" }, "any"),
      splits.map(s => h("option", { value: s, selected: s === f.split }, s)))),
    input("min_reward", "min reward", { type: "number", step: "any" }),
    input("max_reward", "max reward", { type: "number", step: "any" }),
    h("label", {}, "metadata", h("input", { name: "meta", value: meta, placeholder: "key=value" })),
    input("q", "text", { type: "search", placeholder: "in messages and tool calls" }),
    h("button", { type: "submit" }, "filter"),
    link(`/run/${enc(run.name)}`, {}, "clear"));
  form.addEventListener("submit", ev => {
    ev.preventDefault();
    const data = Object.fromEntries(new FormData(form));
    const [key, ...rest] = (data.meta || "").split("=");
    delete data.meta;
    if (key.trim()) Object.assign(data, { meta_key: key.trim(), meta_value: rest.join("=").trim() });
    location.hash = route(`/run/${enc(run.name)}`, data);
  });
  return form;
}

async function trajectoryList(name, filters) {
  const { data, truncated } = await getJSON(`runs/${enc(name)}/trajectories`, filters);
  const table = h("table", { id: "trajectories", class: "grid", "data-count": data.length },
    h("thead", {}, h("tr", {}, ["id", "step", "split", "group", "#", "reward", "metadata"].map(t => h("th", {}, t)))),
    h("tbody", {}, data.map(t => h("tr", { "data-id": t.id, "data-reward": t.reward },
      h("td", {}, link(`/traj/${t.id}`, {}, t.id)), h("td", { class: "num" }, t.step), h("td", {}, t.split),
      h("td", { class: "num" }, link(`/run/${enc(name)}/step/${t.step}/group/${t.group_index}`, { split: t.split }, t.group_index)),
      h("td", { class: "num" }, t.traj_index), h("td", { class: "num" }, fmt(t.reward)),
      h("td", { class: "meta" }, metaSummary(t.metadata))))));
  return h("div", {}, h("p", { class: "muted", id: "trajectory-count" },
    `${data.length}${truncated ? "+" : ""} trajectories`), table);
}

export async function stepView(name, step, query) {
  const split = query.get("split") || "train";
  const { data } = await getJSON(`runs/${enc(name)}/steps/${step}/groups`, { split });
  const node = h("section", {}, h("h1", {}, `${name} · step ${step} · ${split}`),
    h("p", { class: "muted" }, "Groups by reward spread (max − min), widest first: a group with no spread teaches nothing."),
    data.length ? h("table", { id: "groups", class: "grid" },
      h("thead", {}, h("tr", {}, ["group", "n", "mean", "spread", "min … max", "rewards", "task"].map(t => h("th", {}, t)))),
      h("tbody", {}, data.map(g => h("tr", { "data-group": g.group_index, "data-spread": g.spread },
        h("td", {}, link(`/run/${enc(name)}/step/${step}/group/${g.group_index}`, { split }, `group ${g.group_index}`)),
        h("td", { class: "num" }, g.n), h("td", { class: "num" }, fmt(g.mean)), h("td", { class: "num" }, fmt(g.spread)),
        h("td", { class: "num" }, `${fmt(g.min)} … ${fmt(g.max)}`),
        h("td", {}, g.trajectories.map(t => link(`/traj/${t.id}`, {}, h("span", { class: "reward-chip" }, fmt(t.reward))))),
        h("td", { class: "meta" }, metaSummary(g.metadata))))))
    : h("p", { class: "muted" }, "No trajectories stored for this step and split."));
  return { title: `step ${step}`, crumbs: [[name, `/run/${enc(name)}`], [`step ${step} (${split})`, route(`/run/${enc(name)}/step/${step}`, { split })]], node };
}

export async function groupView(name, step, group, query) {
  const split = query.get("split") || "train";
  const { data } = await getJSON(`runs/${enc(name)}/trajectories`, { step, split, group });
  const full = await Promise.all(data.map(t => getJSON(`trajectories/${t.id}`)));
  if (!full.length) throw new Error(`no trajectories in group ${group} of step ${step} (${split})`);
  const rewards = full.map(t => t.reward);
  const mean = rewards.reduce((a, b) => a + b, 0) / (rewards.length || 1);
  const node = h("section", {}, h("h1", {}, `${name} · step ${step} · ${split} · group ${group}`),
    h("p", { class: "muted" }, `${full.length} trajectories · mean reward ${fmt(mean)} · spread ${fmt(Math.max(...rewards) - Math.min(...rewards))}`),
    h("div", { class: "side-by-side", id: "group" }, full.map(t => h("div", { class: "column", "data-id": t.id },
      h("div", { class: "column-head" }, link(`/traj/${t.id}`, {}, `#${t.traj_index}`),
        h("span", { class: "reward-chip" }, `reward ${fmt(t.reward)}`),
        h("span", { class: "muted" }, ` advantage ${fmt(t.reward - mean)}`)),
      chat(t.data, { tokens: false })))));
  return { title: `group ${group}`, node, crumbs: [[name, `/run/${enc(name)}`],
    [`step ${step} (${split})`, route(`/run/${enc(name)}/step/${step}`, { split })], [`group ${group}`, null]] };
}

export async function trajectoryView(id) {
  const t = await getJSON(`trajectories/${enc(id)}`);
  const d = t.data;
  const node = h("section", {}, h("h1", {}, `trajectory ${t.id}`),
    h("p", {}, h("span", { class: "reward-chip big", id: "reward" }, `reward ${fmt(t.reward)}`),
      h("span", { class: "muted" }, ` ${t.run} · step ${t.step} · ${t.split} · group ${t.group_index} · #${t.traj_index}`)),
    h("div", { class: "traj-layout" },
      h("div", { class: "traj-chat" }, legend(), chat(d)),
      h("aside", {}, h("h3", {}, "metrics"), kvTable(d.metrics), h("h3", {}, "metadata"), kvTable(d.metadata),
        d.logs?.length ? [h("h3", {}, "logs"), h("pre", { class: "logs" }, d.logs.join("\n"))] : null,
        d.tools?.length ? [h("h3", {}, "tools"), h("ul", {}, d.tools.map(x => h("li", {}, x.function?.name ?? JSON.stringify(x))))] : null)));
  return { title: `trajectory ${t.id}`, node, crumbs: [[t.run, `/run/${enc(t.run)}`],
    [`step ${t.step} (${t.split})`, route(`/run/${enc(t.run)}/step/${t.step}`, { split: t.split })],
    [`group ${t.group_index}`, route(`/run/${enc(t.run)}/step/${t.step}/group/${t.group_index}`, { split: t.split })],
    [`#${t.traj_index}`, null]] };
}
