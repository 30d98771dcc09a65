// aiayn attention explorer: asks the server for a translation (or an LM continuation) and its attention
// probabilities, and draws one token-aligned SVG heatmap per attention kind, and a small map of every layer and
// head ("model view"). No library, no network beyond this server. Each cell carries data-row, data-col and
// data-weight (the browser test reads them).
"use strict";

const KIND_ORDER = ["cross", "encoder", "decoder_self"];  // the alignment first
// [rows (queries), columns (keys)] per kind, by the model's architecture (/v1/model's page.architecture)
const AXES = {
  "encoder-decoder": {
    encoder: ["source", "source"],
    decoder_self: ["decoder input \u2192 the token it predicts", "decoder input"],
    cross: ["decoder input \u2192 the token it predicts", "source"],
  },
  "decoder-only": { decoder_self: ["token \u2192 the token it predicts", "token"] },
};
// How the page asks the route that serves the run (/v1/model's page.route): the field the request takes, and the
// request; each answers the text to show and the body of its /v1/attention request.
const CALLS = {
  "/v1/translate": {
    field: "beam-field",
    async ask(src) {
      const beam = Number($("beam").value) || 1;
      const t = await api("/v1/translate", { text: [src], beam, nbest: 1 });
      return { shown: t.translations[0].text, attention: { text: src, target: t.translations[0].text } };
    },
  },
  "/v1/generate": {
    field: "new-tokens-field",
    async ask(src) {
      const n = Number($("new-tokens").value) || 40;
      const g = await api("/v1/generate", { prompt: src, temperature: 0, max_new_tokens: n });
      return { shown: src + g.text, attention: { text: src + g.text } };
    },
  },
};
const MIN_CELL = 14;  // px: labels stay readable; a long map scrolls instead of shrinking
const VIRIDIS = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = { page: null, data: null, active: {} };
const $ = (id) => document.getElementById(id);

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const res = await fetch(path, init);
  const json = await res.json().catch(() => null);
  if (!res.ok) {
    const msg = json && json.error ? `${json.error.code}: ${json.error.message}` : `HTTP ${res.status}`;
    throw new Error(msg);
  }
  return json;
}

function color(w) {
  const x = Math.min(1, Math.max(0, w)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const t = x - i;
  const a = VIRIDIS[i], b = VIRIDIS[i + 1];
  const ch = (s, k) => parseInt(s.slice(1 + 2 * k, 3 + 2 * k), 16);
  const mix = [0, 1, 2].map((k) => Math.round(ch(a, k) + t * (ch(b, k) - ch(a, k))));
  return `rgb(${mix.join(",")})`;
}

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// A token as a label: new lines, tabs and spaces as visible symbols (a character model's tokens).
function visible(tok) {
  return tok.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/^ $/, "\u2423");
}

function short(tok) {
  const t = visible(tok);
  return t.length > 14 ? t.slice(0, 13) + "\u2026" : t;
}

// Row labels: the query token, and for the decoder the token its step predicts ("<s> \u2192 \u2581Ein").
function rowLabels(kindData) {
  const p = kindData.predicts;
  return kindData.queries.map((t, q) => (p ? `${short(t)} \u2192 ${short(p[q])}` : short(t)));
}

// The (Q x K) matrix of one layer and one head, or the mean over heads (rows still sum to 1).
function matrix(kindData, layer, head) {
  const l = Math.min(layer, kindData.layers - 1);
  const heads = kindData.weights[l];
  if (head !== "avg") return heads[Math.min(Number(head), kindData.heads - 1)];
  return heads[0].map((row, q) => row.map((_, k) => heads.reduce((s, h) => s + h[q][k], 0) / heads.length));
}

function showCell(svg, q, k) {
  const m = svg._map;
  const rect = svg.querySelector(`rect[data-row="${q}"][data-col="${k}"]`);
  svg.querySelectorAll("rect.active").forEach((r) => r.classList.remove("active"));
  if (!rect) return;
  rect.classList.add("active");
  state.active[svg.dataset.kind] = [q, k];
  const w = Number(rect.dataset.weight);
  $("cell-info").textContent =
    `${m.title}: query "${m.queries[q]}" (row ${q}) \u2192 key "${m.keys[k]}" (column ${k}): ${w.toFixed(4)}`;
  return rect;
}

function heatmap(kind, kindData, layer, head) {
  const W = matrix(kindData, layer, head);
  const { keys, title } = kindData;
  const queries = rowLabels(kindData);
  const axes = AXES[state.page.architecture][kind];
  const cell = Math.max(MIN_CELL, Math.min(28, Math.floor(480 / Math.max(keys.length, queries.length))));
  const left = 16 + 7 * Math.max(...queries.map((t) => t.length));
  const top = 16 + 7 * Math.max(...keys.map((t) => short(t).length));
  const width = left + cell * keys.length + 10;
  const height = top + cell * queries.length + 10;
  const headName = head === "avg" ? "average of the heads" : `head ${head}`;
  const svg = el("svg", {
    width, height, viewBox: `0 0 ${width} ${height}`, role: "img", tabindex: "0",
    "data-kind": kind, "data-layer": String(layer), "data-head": String(head),
    "aria-label": `${title}, layer ${layer}, ${headName}: ${queries.length} ${axes[0]} tokens (rows) by ` +
      `${keys.length} ${axes[1]} tokens (columns). Use the arrow keys to read the weights.`,
  });
  keys.forEach((t, k) => {
    const x = left + k * cell + cell / 2, y = top - 6;
    svg.appendChild(el("text", { x, y, transform: `rotate(-60 ${x} ${y})`, "text-anchor": "start" }, short(t)));
  });
  queries.forEach((t, q) => {
    svg.appendChild(el("text", { x: left - 6, y: top + q * cell + cell / 2 + 4, "text-anchor": "end" }, t));
  });
  W.forEach((row, q) => row.forEach((w, k) => {
    svg.appendChild(el("rect", {
      class: "cell", x: left + k * cell, y: top + q * cell, width: cell, height: cell, fill: color(w),
      "data-row": q, "data-col": k, "data-weight": String(w),
    }));
  }));
  svg._map = { title, queries, keys: keys.map(visible) };
  svg.addEventListener("mousemove", (ev) => {
    const r = ev.target;
    const tip = $("tooltip");
    if (!r.classList || !r.classList.contains("cell")) { tip.hidden = true; return; }
    showCell(svg, Number(r.dataset.row), Number(r.dataset.col));
    tip.textContent = `${queries[r.dataset.row]} : ${visible(keys[r.dataset.col])}: ${Number(r.dataset.weight).toFixed(4)}`;
    tip.style.left = `${ev.clientX + 12}px`;
    tip.style.top = `${ev.clientY + 12}px`;
    tip.hidden = false;
  });
  svg.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  svg.addEventListener("focus", () => {
    const [q, k] = state.active[kind] || [0, 0];
    showCell(svg, q, k);
  });
  svg.addEventListener("keydown", (ev) => {
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    if (!(ev.key in moves)) return;
    ev.preventDefault();
    const [q, k] = state.active[kind] || [0, 0];
    const nq = Math.max(0, Math.min(queries.length - 1, q + moves[ev.key][0]));
    const nk = Math.max(0, Math.min(keys.length - 1, k + moves[ev.key][1]));
    showCell(svg, nq, nk);
  });
  return svg;
}

function render() {
  const box = $("maps");
  box.textContent = "";
  $("tooltip").hidden = true;  // its cell is gone
  renderModelView();
  if (!state.data) return;
  const layer = Number($("layer").value);
  const head = $("head").value;
  const grid = document.createElement("div");
  grid.className = "maps-grid";
  for (const kind of KIND_ORDER) {
    const kindData = state.data.attention[kind];
    if (!kindData) continue;
    const fig = document.createElement("figure");
    fig.className = "map";
    fig.id = `map-${kind}`;
    const cap = document.createElement("figcaption");
    const axes = AXES[state.page.architecture][kind];
    cap.innerHTML = `<h3></h3><span class="axis-note"></span>`;
    cap.querySelector("h3").textContent = kindData.title;
    cap.querySelector("span").textContent = `rows: ${axes[0]} (queries), columns: ${axes[1]} (keys)`;
    fig.appendChild(cap);
    const scroll = document.createElement("div");
    scroll.className = "map-scroll";
    scroll.appendChild(heatmap(kind, kindData, layer, head));
    fig.appendChild(scroll);
    grid.appendChild(fig);
  }
  box.appendChild(grid);
}

// A small picture of one layer and head: a canvas, a few pixels per cell, no labels.
function thumbnail(kindData, layer, head) {
  const W = kindData.weights[layer][head];
  const s = Math.max(2, Math.min(6, Math.floor(96 / Math.max(kindData.keys.length, kindData.queries.length))));
  const canvas = document.createElement("canvas");
  canvas.width = s * kindData.keys.length;
  canvas.height = s * kindData.queries.length;
  const ctx = canvas.getContext("2d");
  W.forEach((row, q) => row.forEach((w, k) => { ctx.fillStyle = color(w); ctx.fillRect(k * s, q * s, s, s); }));
  return canvas;
}

// Every layer (rows) and head (columns) of each kind; a click shows that map large.
function renderModelView() {
  const box = $("model-view");
  box.textContent = "";
  if (!state.data) return;
  const layer = $("layer").value, head = $("head").value;
  for (const kind of KIND_ORDER) {
    const kindData = state.data.attention[kind];
    if (!kindData) continue;
    const fig = document.createElement("figure");
    fig.className = "model-view";
    fig.dataset.kind = kind;
    const cap = document.createElement("figcaption");
    cap.textContent = kindData.title;
    fig.appendChild(cap);
    const table = document.createElement("table");
    const top = table.insertRow();
    top.appendChild(document.createElement("th"));
    for (let h = 0; h < kindData.heads; h++) {
      const th = document.createElement("th");
      th.textContent = `head ${h}`;
      top.appendChild(th);
    }
    for (let l = 0; l < kindData.layers; l++) {
      const tr = table.insertRow();
      const th = document.createElement("th");
      th.textContent = `layer ${l}`;
      tr.appendChild(th);
      for (let h = 0; h < kindData.heads; h++) {
        const button = document.createElement("button");
        button.type = "button";
        button.className = "thumb";
        button.dataset.kind = kind;
        button.dataset.layer = String(l);
        button.dataset.head = String(h);
        button.setAttribute("aria-pressed", String(String(l) === layer && String(h) === head));
        button.setAttribute("aria-label", `${kindData.title}, layer ${l}, head ${h}: show it large`);
        button.appendChild(thumbnail(kindData, l, h));
        button.addEventListener("click", () => {
          $("layer").value = String(l);
          $("head").value = String(h);
          render();
          $(`map-${kind}`).scrollIntoView({ block: "nearest" });
        });
        tr.insertCell().appendChild(button);
      }
    }
    fig.appendChild(table);
    box.appendChild(fig);
  }
}

function fillSelects(data) {
  const kinds = Object.values(data.attention);
  const layers = Math.max(...kinds.map((k) => k.layers));
  const heads = Math.max(...kinds.map((k) => k.heads));
  const layer = $("layer"), head = $("head");
  const keepLayer = layer.value, keepHead = head.value;
  layer.textContent = "";
  head.textContent = "";
  for (let l = 0; l < layers; l++) layer.add(new Option(`layer ${l}`, String(l)));
  head.add(new Option("average of the heads", "avg"));
  for (let h = 0; h < heads; h++) head.add(new Option(`head ${h}`, String(h)));
  layer.value = keepLayer && Number(keepLayer) < layers ? keepLayer : String(layers - 1);
  head.value = keepHead && (keepHead === "avg" || Number(keepHead) < heads) ? keepHead : "0";
  layer.disabled = head.disabled = false;
}

async function run(ev) {
  ev.preventDefault();
  const src = $("src").value;
  const button = $("submit");
  const out = $("output");
  $("error").hidden = true;
  if (!src.trim()) return;
  button.disabled = true;
  out.dataset.state = "busy";
  out.textContent = "\u2026";
  state.data = null;  // the previous sentence's maps go: what is on screen always belongs to the output above
  $("layer").disabled = $("head").disabled = true;
  render();
  $("cell-info").textContent = "";
  try {
    const answer = await CALLS[state.page.route].ask(src);
    out.textContent = answer.shown;
    state.data = await api("/v1/attention", answer.attention);
    state.active = {};
    fillSelects(state.data);
    render();
    out.dataset.state = "done";
  } catch (err) {
    out.dataset.state = "error";
    out.textContent = "\u2014";
    $("error").textContent = err.message;
    $("error").hidden = false;
  } finally {
    button.disabled = false;
  }
}

async function init() {
  $("query-form").addEventListener("submit", run);
  $("src").addEventListener("keydown", (ev) => {  // Enter submits, Shift+Enter is a new line
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("query-form").requestSubmit(); }
  });
  $("layer").addEventListener("change", render);
  $("head").addEventListener("change", render);
  try {
    const m = await api("/v1/model");
    state.page = m.page;
    const millions = (m.parameters / 1e6).toFixed(2);
    const name = String(m.run).split(/[\\/]/).filter(Boolean).pop();  // the run's name, not a path of the server
    $("model-info").textContent = `${m.task} model ${name}: ${millions}M parameters, ${m.config.model.n_heads} ` +
      `heads, on ${m.device}`;
    if (m.config.data.tokenizer === "char") {  // no SentencePiece marks to explain: one label per character
      $("token-legend").innerHTML = "How to read the labels: each is one character; <b>&#x21b5;</b> is a new " +
        "line and <b>&#x2423;</b> a space. The model reads one character per step and predicts the next: its " +
        "rows are labelled <i>input &rarr; predicted</i>.";
    }
    $("src-label").textContent = m.page.source;
    $("submit").textContent = m.page.action;
    for (const [route, call] of Object.entries(CALLS)) $(call.field).hidden = route !== m.page.route;
    document.body.dataset.ready = "true";
  } catch (err) {
    $("error").textContent = `cannot read /v1/model: ${err.message}`;
    $("error").hidden = false;
  }
}

init();
