// Hand-drawn SVG line charts: no library, no build step. Data only ever reaches the DOM as
// attributes and textContent, never as markup.
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4b5563"];

function el(name, attrs, parent) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

// series: [{name, source, points: [[x, y], ...]}]; each line carries data-series="name/source"
// and data-count (its number of points), which is what tests and people can read off it.
export function lineChart(container, series, { xLabel = "step" } = {}) {
  container.replaceChildren();
  const width = container.clientWidth || 600;
  const height = container.clientHeight || 240;
  const pad = { left: 56, right: 12, top: 12, bottom: 28 };
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" }, container);
  const all = series.flatMap((s) => s.points);
  if (all.length === 0) {
    const t = el("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, svg);
    t.textContent = "no points yet";
    return svg;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    el("line", { class: "grid", x1: pad.left, x2: width - pad.right, y1: sy(y), y2: sy(y) }, svg);
    const label = el("text", { x: pad.left - 6, y: sy(y) + 3, "text-anchor": "end" }, svg);
    label.textContent = fmt(y);
  }
  el("line", { class: "axis", x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom }, svg);
  el("line", { class: "axis", x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom }, svg);
  for (const x of [x0, x1]) {
    const t = el("text", { x: sx(x), y: height - pad.bottom + 14, "text-anchor": "middle" }, svg);
    t.textContent = fmt(x);
  }
  const xl = el("text", { x: (width + pad.left) / 2, y: height - 4, "text-anchor": "middle" }, svg);
  xl.textContent = xLabel;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    el("path", { class: "line", d, stroke: color, "data-series": `${s.name}/${s.source}`, "data-count": s.points.length }, svg);
    if (s.points.length === 1) {
      el("circle", { cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 3, fill: color }, svg);
    }
    const legend = el("text", { x: width - pad.right - 4, y: pad.top + 12 * (i + 1), "text-anchor": "end", fill: color }, svg);
    legend.textContent = `${s.name} (${s.source})`;
  });
  return svg;
}
