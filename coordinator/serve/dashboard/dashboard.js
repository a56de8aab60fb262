// The cluster dashboard: polls /v1/cluster/status, /v1/cluster/experts and /metrics every second and
// draws them. No build step and nothing from outside the coordinator. The API key, where the cluster
// has one, comes from the page's #key=... fragment or the key box, and stays in this browser.
"use strict";

const POLL_MS = 1000;
const COLOURS = ["#3b6fb6", "#e67e22", "#8e44ad", "#16a085", "#c0392b", "#7f8c8d", "#d4ac0d", "#2c3e50"];
const $ = (id) => document.getElementById(id);

function apiKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {
    localStorage.setItem("moe-cluster-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);  // the key leaves the address bar
  }
  return localStorage.getItem("moe-cluster-key") || "";
}

class Unauthorized extends Error {}

async function get(path) {
  const key = apiKey();
  const r = await fetch(path, {headers: key ? {"Authorization": "Bearer " + key} : {}, cache: "no-store"});
  if (r.status === 401) throw new Unauthorized(path);
  if (!r.ok && r.status !== 503) throw new Error(`${path}: HTTP ${r.status}`);
  return path === "/metrics" ? r.text() : r.json();
}

// Prometheus text -> {name: [{labels, value}]}
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] = out[m[1]] || []).push({labels, value: Number(m[3])});
  }
  return out;
}

function one(metrics, name, labels = {}) {
  const hit = (metrics[name] || []).find((s) => Object.entries(labels).every(([k, v]) => s.labels[k] === v));
  return hit ? hit.value : undefined;
}

// The median of a histogram, as the upper bound of the bucket holding it (seconds).
function p50(metrics, name, node) {
  const buckets = (metrics[name + "_bucket"] || []).filter((s) => s.labels.node === node);
  const count = one(metrics, name + "_count", {node});
  if (!count) return undefined;
  for (const b of buckets) if (b.value >= count / 2) return b.labels.le === "+Inf" ? Infinity : Number(b.labels.le);
  return undefined;
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log2(n) / 10));
  return (n / 2 ** (10 * i)).toFixed(i ? 1 : 0) + " " + units[i];
}

function seconds(s) {
  if (s === undefined || isNaN(s)) return "–";
  if (s === Infinity) return "> max";
  return s < 1e-3 ? (s * 1e6).toFixed(0) + " µs" : s < 1 ? (s * 1e3).toFixed(1) + " ms" : s.toFixed(2) + " s";
}

// attrs.style is an object set through CSSOM: the page's Content-Security-Policy refuses inline style attributes
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function svg(tag, attrs = {}, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function drawStats(status, metrics) {
  $("model").textContent = status.model;
  $("state").textContent = status.state;
  $("state").className = "badge " + status.state;
  $("reason").textContent = status.state === "ready" ? "" : status.reason;
  const tps = (name) => { const v = one(metrics, name); return v === undefined ? "–" : v.toFixed(1); };
  $("gen-tps").textContent = tps("moe_cluster_generation_tokens_per_second");
  $("prompt-tps").textContent = tps("moe_cluster_prompt_tokens_per_second");
  $("running").textContent = status.running;
  $("waiting").textContent = status.waiting;
  const req = (o) => one(metrics, "moe_cluster_requests_total", {outcome: o}) || 0;
  $("requests").textContent = `${req("ok")} / ${req("error")} / ${req("cancelled")}`;
  $("tokens").textContent = one(metrics, "moe_cluster_generated_tokens_total") || 0;
  const spec = status.speculative;
  $("acceptance").textContent = spec && spec.drafted ? `${Math.round(100 * spec.acceptance)}%` : "–";
  $("allreduces").textContent = spec && spec.allreduces_per_token ? spec.allreduces_per_token.toFixed(2) : "–";
}

function drawNodes(status, metrics) {
  const nodes = status.nodes;
  const body = $("nodes").querySelector("tbody");
  body.replaceChildren(...nodes.map((n, i) => {
    const used = one(metrics, "moe_cluster_node_memory_used_bytes", {node: n.name}) ?? n.used_bytes;
    const budget = one(metrics, "moe_cluster_node_memory_budget_bytes", {node: n.name}) ?? n.budget_bytes;
    const bar = el("span", {class: "bar"}, el("i", {style: {width: `${budget ? Math.min(100, 100 * used / budget) : 0}%`}}));
    const sum = one(metrics, "moe_cluster_allreduce_seconds_sum", {node: n.name});
    const count = one(metrics, "moe_cluster_allreduce_seconds_count", {node: n.name});
    return el("tr", {"data-node": n.name},
      el("td", {style: {borderLeft: `6px solid ${COLOURS[i % COLOURS.length]}`}}, n.name),
      el("td", {}, String(n.rank)),
      el("td", {class: "state-" + n.state, title: n.error || ""}, n.state),
      el("td", {}, n.address), el("td", {}, n.device || "–"),
      el("td", {}, bar, ` ${bytes(used)} / ${bytes(budget)}`),
      el("td", {}, String(one(metrics, "moe_cluster_node_experts", {node: n.name}) ?? n.experts)),
      // the running streams it attends for (all of them with replicated attention), and their KV
      el("td", {class: "streams"}, String(one(metrics, "moe_cluster_node_streams", {node: n.name}) ?? n.streams ?? 0)),
      el("td", {}, bytes(one(metrics, "moe_cluster_node_kv_bytes", {node: n.name}) ?? n.kv_bytes ?? 0)),
      el("td", {}, seconds(p50(metrics, "moe_cluster_allreduce_seconds", n.name))),
      el("td", {}, count ? seconds(sum / count) : "–"),
      el("td", {}, n.last_seen_s === null ? "–" : n.last_seen_s + " s ago"));
  }));
  // every node all-reduces with every other: one link per pair, up while both ends are ready
  const mesh = $("mesh");
  const r = 80, c = 110;
  const at = nodes.map((_, i) => {
    const a = 2 * Math.PI * i / nodes.length - Math.PI / 2;
    return [c + r * Math.cos(a), c + r * Math.sin(a)];
  });
  const parts = [];
  for (let i = 0; i < nodes.length; i++) {
    for (let j = i + 1; j < nodes.length; j++) {
      const up = nodes[i].state === "ready" && nodes[j].state === "ready";
      parts.push(svg("line", {x1: at[i][0], y1: at[i][1], x2: at[j][0], y2: at[j][1], class: up ? "up" : "down"}));
    }
  }
  nodes.forEach((n, i) => {
    const g = svg("g", {"data-node": n.name});
    g.append(svg("circle", {cx: at[i][0], cy: at[i][1], r: 16,
                            fill: n.state === "ready" ? COLOURS[i % COLOURS.length] : "#ccc"}));
    g.append(svg("text", {x: at[i][0], y: at[i][1] + 30}, n.name));
    parts.push(g);
  });
  mesh.replaceChildren(...parts);
}

// white -> yellow -> red as the share of a layer's tokens grows (1/E is "even")
function heat(share, experts) {
  const t = Math.min(1, share * experts / 4);  // four times the even share is full red
  const g = Math.round(255 - 200 * t), b = Math.round(255 * (1 - Math.min(1, 2 * t)));
  return `rgb(255,${g},${b})`;
}

function drawHeat(experts) {
  const names = experts.nodes;
  const colour = (name) => COLOURS[names.indexOf(name) % COLOURS.length];
  $("holders").replaceChildren(...names.map((n) => el("span", {}, el("i", {style: {background: colour(n)}}), n)));
  const layers = experts.layers;
  if (!layers.length) return;
  const width = Math.max(...layers.map((l) => l.tokens.length));
  const head = el("tr", {}, el("th", {}, "layer \\ expert"),
                  ...Array.from({length: width}, (_, e) => el("th", {}, String(e))));
  let hottest = null;
  const rows = layers.map((l) => {
    const total = l.tokens.reduce((a, b) => a + b, 0);
    return el("tr", {"data-layer": l.layer}, el("th", {}, String(l.layer)), ...l.tokens.map((n, e) => {
      const share = total ? n / total : 0;
      if (total && (!hottest || share > hottest.share)) hottest = {layer: l.layer, expert: e, share};
      const held = l.holders[e] || [];
      const title = `layer ${l.layer}, expert ${e}: ${(100 * share).toFixed(1)}% of ${total} tokens; ` +
                    `held by ${held.join(", ") || "no node"}`;
      return el("td", {"data-expert": e, "data-tokens": n, "data-holders": held.join(" "), title,
                       style: {background: heat(share, l.tokens.length),
                               borderBottomColor: held.length ? colour(held[0]) : "#000"}});
    }));
  });
  $("heat").replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
  $("hottest").textContent = hottest ? `Hottest: layer ${hottest.layer}, expert ${hottest.expert} ` +
                                       `(${(100 * hottest.share).toFixed(1)}% of its layer).` : "";
}

async function tick() {
  try {
    const [status, experts, metrics] = await Promise.all(
      [get("/v1/cluster/status"), get("/v1/cluster/experts"), get("/metrics")]);
    const m = parseMetrics(metrics);
    $("auth").hidden = true;
    drawStats(status, m);
    drawNodes(status, m);
    drawHeat(experts);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    if (err instanceof Unauthorized) {
      $("auth").hidden = false;
      $("auth-msg").textContent = apiKey() ? "that key was refused" : "this cluster needs its API key";
    } else {
      $("state").textContent = "unreachable";
      $("state").className = "badge failed";
      $("reason").textContent = String(err.message || err);
    }
  } finally {
    setTimeout(tick, POLL_MS);
  }
}

$("use-key").addEventListener("click", () => {
  localStorage.setItem("moe-cluster-key", $("key").value);
  $("key").value = "";
});
tick();
