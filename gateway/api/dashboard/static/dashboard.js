// ThinkGate dashboard: polls GET /dashboard/data (same-origin, session cookie) and fills the panels.
// Every money cell carries its exact integer in data-micro (micro-USD) and shows the server's USD string.
"use strict";

const POLL_MS = Number(document.body.dataset.pollMs) || 10000;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    // css through the CSSOM: the page's CSP forbids style attributes
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else if (k === "css") Object.assign(e.style, v); else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

// the sign before the currency sign: -$0.002554, as the usage report writes it ("$-0.002554" read as a typo)
function usd(s) {
  if (s === null || s === undefined) return "—";
  const t = String(s);
  return t.startsWith("-") ? "-$" + t.slice(1) : "$" + t;
}
function microToUsd(m) {  // exact: integer micro-USD → decimal string
  if (m === null || m === undefined) return null;
  const neg = m < 0; const a = Math.abs(m); const whole = Math.floor(a / 1e6); const frac = String(a % 1e6).padStart(6, "0");
  return (neg ? "-" : "") + whole + "." + frac;
}
function pct(x) { return x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%"; }
function ms(x) { return x === null || x === undefined ? "—" : x.toFixed(1) + " ms"; }
function money(micro, usdText) {
  return el("td", {"data-micro": String(micro), text: usd(usdText !== undefined ? usdText : microToUsd(micro))});
}

function table(id, head, rows) {
  const t = document.getElementById(id);
  t.replaceChildren(el("tr", {}, ...head.map(h => el("th", {text: h}))), ...rows);
  if (!rows.length) t.append(el("tr", {}, el("td", {colspan: String(head.length), class: "muted", text: "no data in this period"})));
}

function setMoney(id, micro, usdText) {
  const e = document.getElementById(id);
  e.textContent = usd(usdText);
  e.dataset.micro = micro === null || micro === undefined ? "" : String(micro);
}

// what an empty group value means: refused before routing (no tier), refused before auth (no key), no tag
const NONE = {tier: "(not routed: refused)", key: "(no key: refused)", tag: "(untagged)"};

function spendRows(rows, field) {
  return rows.map(r => el("tr", {"data-row": field + ":" + r[field]},
    el("td", {text: r[field] === "" ? NONE[field] : r[field]}),
    el("td", {"data-field": "requests", text: String(r.requests)}),
    el("td", {"data-field": "tokens", text: String(r.prompt_tokens + r.completion_tokens)}),
    money(r.cost_micro_usd, r.cost_usd), money(r.saved_micro_usd, r.saved_usd)));
}

// what the per-event figures cover: the page never passes a window of recent events off as the whole period
function windowLabel(w) {
  if (w.complete) return "all " + w.events + " events of the period";
  const from = w.oldest ? " (since " + new Date(w.oldest * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC)" : "";
  return "last " + w.read + " events only" + from;
}

function render(d) {
  const s = d.savings, t = d.total, w = d.window, ws = w.savings, wl = windowLabel(w);
  setMoney("total-spend", t ? t.cost_micro_usd : 0, t ? t.cost_usd : "0");
  // the shadow calls (the gateway's own, asked by no client) are not requests: counted apart, as the usage report
  // does ("800 requests (1166 events)"); their cost stays in the spend, which is everything paid
  const shadowCalls = s.shadow_requests || 0;
  document.getElementById("total-requests").textContent = ((t ? t.requests : 0) - shadowCalls) + " requests" +
    (shadowCalls ? " + " + shadowCalls + " shadow calls" : "") + " · " + (t ? t.errors : 0) +
    " errors · " + (t ? t.refused : 0) + " refused";
  // the counterfactual needs each event's difficulty and tokens: computed over the event window, and said so
  setMoney("always-long", ws.always_long_micro_usd, ws.always_long_usd);
  document.getElementById("long-tier").textContent = "every request on tier " + s.long_tier + " (estimate) · " + wl;
  // savings on served traffic; the shadow calls (paid to label cheap answers for retraining) are their own card,
  // with the saving net of them: counted in, a first day's learning read as routing losing money
  setMoney("savings", ws.savings_micro_usd, ws.savings_usd);
  document.getElementById("savings-fraction").textContent = pct(ws.savings_fraction) + " of always-long, on served traffic · " + wl;
  setMoney("shadow-spend", s.shadow_spend_micro_usd, s.shadow_spend_usd);
  const net = document.getElementById("net-savings");
  net.textContent = "net of them saved " + usd(ws.net_savings_usd) + " · " + wl;
  net.dataset.micro = ws.net_savings_micro_usd === null || ws.net_savings_micro_usd === undefined ? "" : String(ws.net_savings_micro_usd);
  document.body.dataset.windowComplete = String(w.complete);
  document.body.dataset.windowRead = String(w.read);
  for (const id of ["routing-window", "latency-window"]) document.getElementById(id).textContent = wl;
  setMoney("cache-saved", s.cache_saved_micro_usd, s.cache_saved_usd);
  document.getElementById("cache-hits").textContent = (t ? t.cache_hits : 0) + " cache hits";

  const days = d.spend.day, max = Math.max(1, ...days.map(r => r.cost_micro_usd));
  document.getElementById("spend-day").replaceChildren(...days.map(r => el("div", {class: "bar", "data-row": "day:" + r.day, "data-micro": String(r.cost_micro_usd), title: r.day + ": $" + r.cost_usd},
    el("span", {text: "$" + Number(r.cost_usd).toFixed(4)}),
    el("div", {class: "fill", css: {height: (80 * r.cost_micro_usd / max).toFixed(1) + "%"}}),
    el("span", {class: "lbl", text: r.day.slice(5)}))));
  if (!days.length) document.getElementById("spend-day").append(el("span", {class: "muted", text: "no spend in this period"}));
  const head = ["", "requests", "tokens", "spend", "cache saved"];
  table("spend-key", ["key", ...head.slice(1)], spendRows(d.spend.key, "key"));
  table("spend-tier", ["tier", ...head.slice(1)], spendRows(d.spend.tier, "tier"));
  table("spend-tag", ["tag", ...head.slice(1)], spendRows(d.spend.tag, "tag"));

  const r = d.routing;
  document.getElementById("routing-note").textContent = "router " + r.router + " · thresholds " + JSON.stringify(r.thresholds) +
    (r.target_source === "routing.target" ? " · target: routing.target (the controller moves the top cut point)"
      : r.calibration ? " · target: the router file's calibration (" + r.calibration.method + ")"
      : " · no target share (thresholds set in the config, or a router file without a calibration)") +
    " · share of " + r.predicted_requests + " router-decided requests";
  table("routing", ["tier", "requests", "router share", "target share", "reasons"], r.tiers.map(x => el("tr", {"data-row": "tier:" + x.tier},
    el("td", {text: x.tier}), el("td", {"data-field": "requests", text: String(x.requests)}),
    el("td", {"data-field": "share"}, el("span", {class: "share", css: {width: (60 * (x.share || 0)).toFixed(0) + "px"}}), " " + pct(x.share)),
    el("td", {"data-field": "target_share"}, el("span", {class: "target", css: {width: (60 * (x.target_share || 0)).toFixed(0) + "px"}}), " " + pct(x.target_share)),
    el("td", {class: "muted", text: Object.entries(x.reasons).map(([k, v]) => k + " " + v).join(", ")}))));

  table("budgets", ["level", "period", "budget", "spent", "reserved", "remaining", ""], d.budgets.map(b => {
    const used = Number(b.budget_usd) > 0 ? (Number(b.spent_usd) + Number(b.reserved_usd)) / Number(b.budget_usd) : 0;
    const level = b.level === "key" ? "key " + b.key_id : b.level;
    return el("tr", {"data-row": "budget:" + level + ":" + b.period},
      el("td", {text: level}), el("td", {text: b.period}), el("td", {text: usd(b.budget_usd)}),
      el("td", {text: usd(b.spent_usd)}), el("td", {text: usd(b.reserved_usd)}),
      el("td", {"data-field": "remaining", text: usd(b.remaining_usd)}),
      el("td", {}, el("span", {class: "meter" + (used >= 1 ? " bad" : used >= 0.8 ? " warn" : "")},
        el("span", {css: {width: Math.min(100, 100 * used).toFixed(0) + "%"}}))));
  }));

  table("latency", ["tier", "events", "p50", "p99", "TTFT p50", "error rate"], d.latency.map(x => el("tr", {"data-row": "tier:" + x.tier},
    el("td", {text: x.tier}), el("td", {"data-field": "events", text: String(x.events)}),
    el("td", {"data-field": "p50_ms", text: ms(x.p50_ms)}), el("td", {"data-field": "p99_ms", text: ms(x.p99_ms)}),
    el("td", {text: ms(x.ttft_p50_ms)}), el("td", {"data-field": "error_rate", text: pct(x.error_rate) + " (" + x.errors + ")"}))));

  const ul = document.getElementById("alerts");
  const when = a => new Date(a.fired_at * 1000).toISOString().slice(0, 19).replace("T", " ");
  ul.replaceChildren(...d.alerts.map(a => el("li", {"data-type": a.type, text: a.type === "drift_alert"
    ? when(a) + " · drift · router " + a.router_version + " " + a.kind + " PSI " + Number(a.psi).toFixed(3) +
      " ≥ " + a.threshold + " over " + a.n + " requests"
    : when(a) + " · " + (a.level === "key" ? "key " + a.key_id : a.level) + " · " + a.period + " " + a.period_id +
      " · " + Math.round(a.fraction * 100) + "% of $" + a.budget_usd + " (spent $" + a.spent_usd + ")"})));
  if (!d.alerts.length) ul.append(el("li", {class: "muted", text: "no alert raised"}));

  const hist = document.getElementById("router-history");
  const at = h => new Date(h.ts * 1000).toISOString().slice(0, 19).replace("T", " ");
  hist.replaceChildren(...d.router_history.map(h => el("li", {"data-event": h.event, text: at(h) + " · " + h.event +
    (h.event === "promote" ? " · now " + h.version + " (was " + (h.previous || "—") + ")"
      : h.event === "rollback" ? " · back to " + (h.version || "—") + " from " + h.previous
      : " · kept " + (h.version || "—")) +
    (h.outcomes != null ? " · " + h.outcomes + " outcomes" : "") + (h.reason ? " · " + h.reason : "")})));
  if (!d.router_history.length) hist.append(el("li", {class: "muted", text: "no promotion, refusal or rollback yet (routing.retrain)"}));
}

function unavailable(message) {
  const st = document.getElementById("status");
  st.textContent = message; st.hidden = false;
  document.getElementById("updated").textContent = "no figures · checked " + new Date().toISOString().slice(11, 19) + " UTC";
  document.getElementById("panels").hidden = true;  // never show stale or zero figures as if they were current
  document.body.dataset.state = "unavailable";
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/data", {credentials: "same-origin", cache: "no-store"});
    if (resp.status === 401) { window.location.assign("/dashboard"); return; }
    const d = await resp.json();
    if (resp.status === 503 || d.redis !== "ok") {
      unavailable("Redis is unreachable: no usage figures until it answers");
    } else if (!resp.ok) {
      unavailable("the dashboard data failed: HTTP " + resp.status);
    } else {
      render(d);
      document.getElementById("status").hidden = true;
      document.getElementById("panels").hidden = false;
      document.body.dataset.state = "ready";
      document.body.dataset.since = String(d.since);
      document.getElementById("updated").textContent = "since " + new Date(d.since * 1000).toISOString().slice(0, 10) +
        " · updated " + new Date(d.generated * 1000).toISOString().slice(11, 19) + " UTC";
    }
  } catch (e) {
    unavailable("the gateway did not answer: " + e);
  }
  setTimeout(poll, POLL_MS);
}

poll();
