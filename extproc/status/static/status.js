// The status page: polls /v1/status and redraws. No framework, no build step, nothing fetched
// from anywhere but this server. Values are written with textContent (never parsed as HTML).
"use strict";

const POLL_MS = 1000;
const TIMEOUT_MS = 3000;
const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a fetch

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

function num(value, digits = 0) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString("en-US", {
    minimumFractionDigits: digits, maximumFractionDigits: digits,
  });
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  return value >= 1000 ? `${num(value / 1000, 2)} s` : `${num(value, value < 10 ? 1 : 0)} ms`;
}

function clock(unix) {
  if (unix === null || unix === undefined) return "earlier";
  return new Date(unix * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

function cell(field, value, cls) {
  return el("td", { "data-field": field, class: cls || "" }, value);
}

function summaryItem(label, value, field) {
  const shown = value instanceof Node ? value : el("span", {}, value);
  return el("div", { class: "item" },
    el("span", { class: "label" }, label),
    el("span", { class: "value", "data-field": field }, shown));
}

function renderSummary(status) {
  const policy = status.policy;
  const last = policy.last_reload;
  let reload;
  if (!last) reload = el("span", { class: "badge ok" }, "loaded at start");
  else {
    const cls = last.result === "error" ? "bad" : "ok";
    const errors = last.errors.length ? ` (${last.errors.length} errors)` : "";
    reload = el("span", {},
      el("span", { class: `badge ${cls}` }, last.result), ` ${clock(last.at)} via ${last.trigger}${errors}`);
  }
  const version = policy.fingerprint ? policy.fingerprint.replace(/^sha256:/, "").slice(0, 12) : "–";
  const parts = [
    summaryItem("queued", num(status.queued), "queued"),
    summaryItem("in flight", num(status.inflight), "inflight"),
    summaryItem("policy", version, "policy-version"),
    summaryItem("fairness", policy.fairness, "fairness"),
    summaryItem("tenants", num(policy.tenants), "tenant-count"),
    summaryItem("last reload", reload, "last-reload"),
  ];
  if (status.overload) parts.push(summaryItem("overload", overloadText(status.overload), "overload"));
  if (status.draining) parts.push(summaryItem("state", el("span", { class: "badge bad" }, "draining"), "draining"));
  document.getElementById("summary").replaceChildren(...parts);
}

function overloadText(o) {
  if (!o.enabled) return "shedding off";
  const wait = o.cpu_wait === null ? "" : ` · CPU wait ${Math.round(100 * o.cpu_wait)}%`;
  const readings = ` (loop lag ${ms(o.lag_ms)}${wait})`;
  if (!o.shedding) return el("span", {}, el("span", { class: "badge ok" }, "keeping up"), readings);
  const whom = o.shed_tenants.length ? ` ${o.shed_tenants.join(", ")}` : "";
  return el("span", {}, el("span", { class: "badge bad" }, `shedding (${o.reason})`), whom, readings);
}

function outcomesText(outcomes) {
  const rejected = Object.entries(outcomes).filter(([name]) => name !== "admitted" && name !== "cancelled");
  return rejected.map(([name, count]) => `${name.replace("rejected_", "")} ${count}`).join(", ");
}

function fairText(places) {
  if (!places.length) return "–";
  return places.map((p) => `${p.pool} #${p.position}/${p.of}`).join("  ");
}

function renderTenants(status) {
  const rows = [];
  for (const tier of status.tiers) {
    rows.push(el("tr", { class: "tier", "data-tier": tier.name }, el("td", { colSpan: 12 }, tier.name)));
    for (const t of tier.tenants) {
      const rates = t.tokens_per_s || {};
      const rejected = el("span", { "data-field": "rejected" }, num(t.rejected));
      const breakdown = outcomesText(t.outcomes);
      rows.push(el("tr", { "data-tenant": t.name },
        el("td", {}, t.name),
        cell("weight", num(t.weight, 1)),
        cell("queued", num(t.queued), t.queued > 0 ? "busy" : ""),
        cell("inflight", num(t.inflight)),
        cell("admitted", num(t.admitted)),
        el("td", { class: t.rejected > 0 ? "bad" : "" },
          rejected, breakdown ? el("span", { class: "sub" }, breakdown) : null),
        cell("tokens-in", num(rates.input, 0)),
        cell("tokens-out", num(rates.output, 0)),
        el("td", { "data-field": "fair-share", title: t.fair_share.map((p) => `${p.pool}: ${p.level}`).join(", ") },
          fairText(t.fair_share)),
        cell("ttft", `${ms(t.ttft.p50_ms)} / ${ms(t.ttft.p99_ms)}`),
        cell("inter-token", `${ms(t.inter_token.p50_ms)} / ${ms(t.inter_token.p99_ms)}`),
        cell("queue-wait", `${ms(t.queue_wait.p50_ms)} / ${ms(t.queue_wait.p99_ms)}`),
      ));
    }
  }
  document.getElementById("tenant-rows").replaceChildren(...rows);
  const w = status.windows;
  document.getElementById("windows").textContent =
    `Token rates over the last ${w.rates_s === null ? "–" : num(w.rates_s, 0)} s; ` +
    `latency percentiles over the last ${w.latency_s === null ? "(since start)" : `${num(w.latency_s, 0)} s`}. ` +
    "Inter-token: the gap between streamed chunks that carry output, per token. " +
    "Admitted and rejected: requests since start, counted when they end. " +
    "Fair-share place: 1 is served next among the tier's tenants in that pool.";
}

function chart(history) {
  const width = 400, height = 90, pad = 4;
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img" });
  if (history.length < 2) {
    const text = svg("text", { x: 8, y: 20, fill: "#6b7385", "font-size": 12 });
    text.textContent = "limit history fills in while this page is open";
    root.append(text);
    return root;
  }
  const t0 = history[0][0], t1 = history[history.length - 1][0];
  const top = Math.max(1, ...history.map((p) => Math.max(p[1], p[2], p[3], p[4])));
  const x = (t) => pad + ((t - t0) / Math.max(1e-9, t1 - t0)) * (width - 2 * pad);
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  const series = [[2, "#9aa4b8", "4 3"], [1, "#2f6fdf", ""], [3, "#1f9d55", ""], [4, "#c27c0e", ""]];
  for (const [index, color, dash] of series) {
    const points = history.map((p) => `${x(p[0]).toFixed(1)},${y(p[index]).toFixed(1)}`).join(" ");
    root.append(svg("polyline", {
      points, fill: "none", stroke: color, "stroke-width": 2, "stroke-dasharray": dash,
      "vector-effect": "non-scaling-stroke",
    }));
  }
  return root;
}

function scaleText(history) {
  if (history.length < 2) return null;
  const top = Math.max(1, ...history.map((p) => Math.max(p[1], p[2], p[3], p[4])));
  const span = Math.round(history[history.length - 1][0] - history[0][0]);
  return el("span", { class: "scale" }, `top of chart ${top} · last ${span} s`);
}

function legend(history) {
  const item = (color, label) => {
    const swatch = el("i", {});
    swatch.style.background = color;
    return el("span", {}, swatch, label);
  };
  return el("div", { class: "legend" },
    item("#2f6fdf", "soft limit"), item("#9aa4b8", "hard limit"),
    item("#1f9d55", "in flight"), item("#c27c0e", "queued"), scaleText(history));
}

function figure(label, value, field) {
  return el("div", { class: "figure" },
    el("div", { class: "label" }, label), el("div", { class: "value", "data-field": field }, value));
}

function kvBar(usage) {
  const bar = el("span", { class: "bar" });
  const fill = el("b", {});
  fill.style.width = `${Math.min(100, Math.max(0, usage * 100)).toFixed(0)}%`;
  if (usage > 0.9) fill.style.background = "#c8362f";
  bar.append(fill);
  return el("span", {}, bar, `${num(usage * 100, 0)}%`);
}

function engineRows(engines) {
  if (!engines.length) return [el("tr", {}, el("td", { colSpan: 5, class: "empty" }, "no engines"))];
  return engines.map((e) => el("tr", { "data-engine": e.endpoint },
    el("td", {}, e.endpoint),
    cell("running", e.answered ? num(e.running) : "–"),
    cell("waiting", e.answered ? num(e.waiting) : "–", e.waiting > 0 ? "busy" : ""),
    el("td", { "data-field": "kv" }, e.answered ? kvBar(e.kv_usage) : "–"),
    cell("age", e.age_s === null ? "not read yet" : e.answered ? `${num(e.age_s, 1)} s ago` : "no answer",
      e.age_s !== null && !e.answered ? "bad" : ""),
  ));
}

function renderPools(status) {
  const cards = status.pools.map((p) => {
    const kind = p.adaptive
      ? el("span", { class: "badge ok" }, `adaptive ▲${p.limit_increases} ▼${p.limit_decreases}`)
      : el("span", { class: "badge warn" }, "static");
    const engines = el("table", { class: "grid" },
      el("thead", {}, el("tr", {},
        el("th", { class: "name" }, "engine"), el("th", {}, "running"), el("th", {}, "waiting"),
        el("th", {}, "KV cache"), el("th", {}, "read"))),
      el("tbody", {}, ...engineRows(p.engines)));
    return el("div", { class: "pool", "data-pool": p.name },
      el("h3", {}, p.name, kind, p.retired ? el("span", { class: "badge bad" }, "retired") : null),
      el("div", { class: "figures" },
        figure("in flight", num(p.inflight), "inflight"),
        figure("queued", num(p.queued), "queued"),
        figure("soft limit", num(p.soft_limit), "soft-limit"),
        figure("hard limit", num(p.hard_limit), "hard-limit"),
        figure("drain /s", num(p.drain_rate, 1), "drain-rate"),
        p.configured_max_inflight ? figure("configured", num(p.configured_max_inflight), "configured") : null),
      chart(p.history), legend(p.history), engines);
  });
  document.getElementById("pools").replaceChildren(...cards);
}

function renderRejections(status) {
  const rows = status.rejections.map((r) => el("tr", { "data-outcome": r.outcome },
    el("td", {}, clock(r.at)),
    el("td", { class: "text", "data-field": "tenant" }, r.tenant === null ? "unidentified" : r.tenant),
    el("td", { class: "text" }, r.tier || "–"), el("td", { class: "text" }, r.pool || "–"),
    cell("status", r.status, "bad"),
    el("td", { class: "text bad", "data-field": "reason" }, `${r.reason} (${r.outcome})`),
    cell("retry-after", r.retry_after_s === null ? "–" : `${num(r.retry_after_s)} s`),
    el("td", { class: "text message", "data-field": "message", title: r.message }, r.message)));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colSpan: 8, class: "empty" }, "none so far")));
  document.getElementById("rejection-rows").replaceChildren(...rows);
}

function render(status) {
  renderSummary(status);
  renderTenants(status);
  renderPools(status);
  renderRejections(status);
  const updated = document.getElementById("updated");
  updated.textContent = `live · updated ${clock(status.generated_at)}`;
  updated.setAttribute("data-generated-at", String(status.generated_at));
  document.getElementById("live-dot").className = "dot ok";
}

function stale(reason) {
  document.getElementById("updated").textContent = `not updating: ${reason}`;
  document.getElementById("live-dot").className = "dot stale";
}

async function poll() {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
  try {
    const response = await fetch("/v1/status", { cache: "no-store", signal: controller.signal });
    const body = await response.json();
    if (response.ok) render(body);
    else stale(body.error || `HTTP ${response.status}`);
  } catch (error) {
    stale(error.name === "AbortError" ? "no answer in time" : "admin server unreachable");
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}

poll();
