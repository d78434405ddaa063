// Line plots as inline SVG: one per metric, a few series each, steps on the x axis.
import { h, fmt } from "./dom.js";

const PAD = { l: 52, r: 12, t: 10, b: 26 };

// series: [{name, points: [{x, y}]}]; points with a null y (a figure a step did not have) are skipped.
// width/height are in the SVG's own units: text keeps its size when a wide plot is drawn wider.
export function linePlot(title, series, { metric = title, width: W = 360, height: H = 170 } = {}) {
  const clean = series.map(s => ({ ...s, points: s.points.filter(p => p.y != null && Number.isFinite(p.y)) }));
  const all = clean.flatMap(s => s.points);
  const fig = h("figure", { class: "plot", "data-metric": metric }, h("figcaption", {}, title));
  if (!all.length) return fig.appendChild(h("p", { class: "muted" }, "no data")), fig;

  const xs = all.map(p => p.x);
  const [x0, x1] = [Math.min(...xs) - 0.5, Math.max(...xs) + 0.5];  // half a step each side
  const yTicks = niceTicks(all.map(p => p.y));
  const [y0, y1] = [yTicks[0], yTicks[yTicks.length - 1]];
  const sx = x => PAD.l + (x - x0) / (x1 - x0) * (W - PAD.l - PAD.r);
  const sy = y => H - PAD.b - (y - y0) / (y1 - y0) * (H - PAD.t - PAD.b);

  const svg = h("svg:svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title });
  svg.append(h("svg:rect", { class: "frame", x: PAD.l, y: PAD.t, width: W - PAD.l - PAD.r, height: H - PAD.t - PAD.b }));
  const label = tickFormat(yTicks);
  for (const y of yTicks) {
    svg.append(h("svg:line", { class: "grid", x1: PAD.l, x2: W - PAD.r, y1: sy(y), y2: sy(y) }),
               h("svg:text", { class: "tick", x: PAD.l - 4, y: sy(y) + 3, "text-anchor": "end" }, label(y)));
  }
  for (const x of stepTicks(x0, x1)) {
    svg.append(h("svg:text", { class: "tick", x: sx(x), y: H - PAD.b + 14, "text-anchor": "middle" }, x));
  }
  svg.append(h("svg:text", { class: "tick", x: W - PAD.r, y: H - 2, "text-anchor": "end" }, "step"));
  clean.forEach((s, i) => {
    const pts = [...s.points].sort((a, b) => a.x - b.x);
    const g = h("svg:g", { class: `series s${i}`, "data-series": s.name });
    if (pts.length > 1) g.append(h("svg:polyline", { points: pts.map(p => `${sx(p.x)},${sy(p.y)}`).join(" ") }));
    for (const p of pts) {
      g.append(h("svg:circle", { class: "pt", cx: sx(p.x), cy: sy(p.y), r: 3, "data-x": p.x, "data-y": p.y },
                  h("svg:title", {}, `${s.name} · step ${p.x}: ${fmt(p.y)}`)));
    }
    svg.append(g);
  });
  fig.append(svg);
  if (clean.length > 1) {
    fig.append(h("div", { class: "legend" }, clean.map((s, i) => h("span", { class: `key s${i}` }, s.name))));
  }
  return fig;
}

// Round tick values (1, 2 or 5 times a power of ten) that enclose the data; a constant figure
// still gets a range around it, so its line is drawn mid-plot rather than on the frame.
function niceTicks(values, target = 4) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi === lo) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
  const raw = (hi - lo) / target, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const first = Math.floor(lo / step) * step, out = [];
  for (let v = first; v < hi + step * 0.999; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// As many decimals as the tick step needs, so close ticks (entropy 7.5712, 7.5714) stay apart.
function tickFormat(ticks) {
  const step = ticks[1] - ticks[0], top = Math.max(...ticks.map(Math.abs));
  const stepExp = Math.floor(Math.log10(step)), digits = Math.max(0, -stepExp);
  if (top >= 1e6 || (top < 1e-3 && top > 0)) {
    const mantissa = Math.max(1, Math.floor(Math.log10(top)) - stepExp);
    return v => (v === 0 ? "0" : v.toExponential(mantissa));
  }
  return v => String(Number(v.toFixed(digits)));
}

function stepTicks(lo, hi) {
  const first = Math.ceil(lo), last = Math.floor(hi);
  const every = Math.max(1, Math.ceil((last - first + 1) / 8));
  const out = [];
  for (let x = first; x <= last; x += every) out.push(x);
  return out;
}
