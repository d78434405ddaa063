// A trajectory as a chat: context messages, the model's sampled turns (Choices) with their
// tool calls, tool results, and each sampled token coloured by the logprob the sampler gave it.
import { h, fmt } from "./dom.js";

const isChoice = item => item && typeof item === "object" && "message" in item && "finish_reason" in item;

export function chat(traj, { tokens = true } = {}) {
  const toolNames = {};  // tool_call_id -> name, so a result says which call it answers
  const out = h("div", { class: "chat" });
  for (const item of traj.messages_and_choices || []) {
    if (isChoice(item)) {
      for (const c of item.message?.tool_calls || []) toolNames[c.id] = c.function?.name;
      out.append(assistantTurn(item, tokens));
    } else {
      for (const c of item.tool_calls || []) toolNames[c.id] = c.function?.name;
      out.append(message(item, toolNames));
    }
  }
  return out;
}

function message(m, toolNames) {
  const role = m.role || "?";
  const head = [h("span", { class: "role" }, role)];
  if (role === "tool") head.push(h("span", { class: "muted" }, ` ← ${toolNames[m.tool_call_id] || "tool"} (${m.tool_call_id || "?"})`));
  return h("div", { class: `msg role-${role}` }, h("div", { class: "msg-head" }, head),
           content(m.content), (m.tool_calls || []).map(toolCall));
}

function assistantTurn(choice, withTokens) {
  const m = choice.message || {};
  const s = choice.sampling || {};
  const head = h("div", { class: "msg-head" }, h("span", { class: "role" }, "assistant"),
                 h("span", { class: "muted" }, ` sampled by ${s.policy ?? "?"} (step ${s.step ?? "?"}),` +
                   ` T=${fmt(s.temperature)}, finish: ${choice.finish_reason}`));
  const lps = choice.logprobs?.content || [];
  return h("div", { class: "msg role-assistant sampled" }, head, content(m.content),
           (m.tool_calls || []).map(toolCall),
           withTokens && lps.length ? tokenStrip(lps) : null);
}

function content(c) {
  if (c == null || c === "") return null;
  const text = typeof c === "string" ? c : (Array.isArray(c) ? c.map(p => p.text ?? JSON.stringify(p)).join("\n") : JSON.stringify(c));
  return h("div", { class: "content" }, text);
}

function toolCall(call) {
  const fn = call.function || {};
  let args = fn.arguments ?? "";
  try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* shown as sent: a malformed call is worth seeing */ }
  return h("div", { class: "tool-call" }, h("span", { class: "tool-name" }, `${fn.name}(…)`),
           h("span", { class: "muted" }, ` ${call.id || ""}`), h("pre", { class: "tool-args" }, args));
}

// Green is a token the model was sure of, red one it rarely picks: a red run in a trained turn
// is where a sampled surprise gets reinforced. The hue follows p^(1/3), not p, so unlikely tokens
// still differ from each other (an untrained model samples mostly at logprob -5 to -10).
export function logprobColor(lp) {
  const t = Math.exp(Math.max(lp, -60) / 3);
  return `hsl(${Math.round(120 * t)}, 75%, ${Math.round(80 + 8 * t)}%)`;
}

function tokenStrip(lps) {
  const strip = h("div", { class: "tokens" });
  for (const t of lps) {
    const span = h("span", { class: "tok", "data-logprob": t.logprob,
                             title: `${JSON.stringify(t.token)}  logprob ${fmt(t.logprob)}  p=${fmt(Math.exp(t.logprob))}` },
                   t.token);
    span.style.backgroundColor = logprobColor(t.logprob);
    strip.append(span);
  }
  return h("details", { class: "token-view", open: true },
           h("summary", {}, `${lps.length} sampled tokens, coloured by logprob`), strip);
}

export function legend() {
  return h("div", { class: "lp-legend" }, "logprob: ",
           [0, -0.5, -1, -2, -4, -7, -10].map(lp => {
             const s = h("span", { class: "swatch" }, String(lp));
             s.style.backgroundColor = logprobColor(lp);
             return s;
           }));
}
