// compactor inspector: a client of the admin API (GET /_compactor/sessions
// and GET /_compactor/sessions/{key}). The admin token stays in this tab's
// sessionStorage and goes only into the Authorization header, never a URL.
"use strict";

(function () {
  const API = "/_compactor/sessions";
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let chart = null;
  let listRows = [];

  const token = () => sessionStorage.getItem("compactor-admin-token") || "";

  function show(view) {
    for (const id of ["login", "list-view", "conv-view"]) $(id).hidden = id !== view;
    $("logout").hidden = view === "login";
  }

  async function getJson(path) {
    const resp = await fetch(path, {
      headers: { Authorization: "Bearer " + token() },
      cache: "no-store",
      credentials: "omit",
    });
    if (resp.status === 401 || resp.status === 403) {
      const body = await resp.json().catch(() => ({}));
      const err = new Error((body.error && body.error.message) || "not authorised");
      err.auth = true;
      throw err;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    return resp.json();
  }

  const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined ? "–" : Math.round(x * 100) + " %");

  function ago(ms) {
    if (ms === null || ms === undefined) return "–";
    const s = Math.round(ms / 1000);
    if (s < 60) return s + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    return Math.round(s / 3600) + " h ago";
  }

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function occupancy(td, s) {
    const wrap = document.createElement("div");
    wrap.className = "occ";
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.className = "fill";
    const real = s.last_real_prompt_tokens;
    const win = s.window;
    if (real && win) {
      const share = Math.min(real / win, 1);
      fill.style.width = (share * 100).toFixed(1) + "%";
      if (s.threshold_tokens && real >= s.threshold_tokens) fill.classList.add("hot");
      if (real >= win) fill.classList.add("over");
    } else {
      fill.style.width = "0";
    }
    bar.appendChild(fill);
    if (s.threshold_tokens && win) {
      const trig = document.createElement("div");
      trig.className = "trig";
      trig.style.left = (Math.min(s.threshold_tokens / win, 1) * 100).toFixed(1) + "%";
      trig.title = "trigger " + fmt(s.threshold_tokens);
      bar.appendChild(trig);
    }
    const label = document.createElement("span");
    label.className = "occ-text";
    label.textContent = fmt(real) + " / " + fmt(win) + (s.threshold_tokens ? " (trigger " + fmt(s.threshold_tokens) + ")" : "");
    wrap.append(bar, label);
    td.appendChild(wrap);
  }

  function renderList() {
    const q = $("filter").value.trim().toLowerCase();
    const rows = listRows.filter((s) =>
      !q || [s.session, s.api, s.model, s.id_kind].some((v) => v && String(v).toLowerCase().includes(q)));
    const body = $("sessions").tBodies[0];
    body.replaceChildren();
    for (const s of rows) {
      const tr = document.createElement("tr");
      tr.dataset.session = s.session;
      cell(tr, ago(s.idle_ms), "activity");
      const keyTd = cell(tr, "", "session");
      const a = document.createElement("a");
      a.href = "#/s/" + encodeURIComponent(s.session);
      a.textContent = s.session.slice(0, 12) + "…";
      keyTd.appendChild(a);
      if (s.busy) {
        const b = document.createElement("span");
        b.className = "badge";
        b.textContent = "compacting";
        keyTd.append(" ", b);
      }
      cell(tr, s.api || "–", "api");
      cell(tr, s.model || "–", "model");
      cell(tr, s.id_kind || "–", "id-kind");
      occupancy(cell(tr, "", "occupancy"), s);
      cell(tr, fmt(s.turns), "num turns");
      cell(tr, fmt(s.compactions) + (s.fallback_compactions ? " (" + s.fallback_compactions + " fallback)" : ""), "num compactions");
      cell(tr, fmt(s.summary_calls), "num summary-calls");
      cell(tr, fmt(s.tokens_saved), "num tokens-saved");
      cell(tr, pct(s.prefix_stable_share), "num prefix-stable");
      const cache = s.usage_reports ? fmt(s.cache_hit_turns) + "/" + fmt(s.usage_reports) + " turns, last " + fmt(s.last_cached_tokens) : "–";
      cell(tr, cache, "num cache");
      body.appendChild(tr);
    }
    $("count").textContent = rows.length + " of " + listRows.length + " shown";
    $("empty").hidden = listRows.length > 0;
  }

  async function refreshList() {
    const data = await getJson(API + "?limit=500");
    listRows = data.sessions;
    renderList();
  }

  function figure(dl, name, value) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dl.append(dt, dd);
  }

  function markerSeries(label, color, shape) {
    return {
      label,
      stroke: color,
      fill: color,
      width: 0,
      paths: () => null,
      points: { show: true, size: shape === "big" ? 11 : 9, stroke: color, fill: color },
    };
  }

  function drawChart(v) {
    const turns = v.turn_figures || [];
    const x = turns.map((t) => t.turn);
    const at = (pred) => turns.map((t) => (pred(t) ? (t.real_prompt_tokens ?? t.est_tokens) : null));
    const data = [
      x,
      turns.map((t) => t.real_prompt_tokens ?? null),
      turns.map((t) => t.est_tokens),
      turns.map((t) => t.window),
      turns.map((t) => t.trigger_tokens ?? null),
      at((t) => t.compacted && !t.background),
      at((t) => t.background),
      at((t) => t.overflow_retry),
      at((t) => t.aborted),
    ];
    const el = $("chart");
    el.dataset.points = String(x.length);
    el.dataset.compactions = String(turns.filter((t) => t.compacted).length);
    const width = Math.max(el.clientWidth - 20, 400);
    if (chart && chart.series.length === data.length) {
      chart.setData(data);
      chart.setSize({ width, height: 300 });
    } else {
      if (chart) chart.destroy();
      chart = new uPlot({
        width,
        height: 300,
        scales: { x: { time: false } },
        axes: [{ label: "turn", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] }, { label: "prompt tokens", size: 70 }],
        series: [
          { label: "turn" },
          { label: "real prompt", stroke: "#1f5fbf", width: 2, spanGaps: false, points: { show: true, size: 5 } },
          { label: "estimate", stroke: "#8aa4c8", width: 1, dash: [4, 4] },
          { label: "window", stroke: "#c62828", width: 1 },
          { label: "trigger", stroke: "#e0862b", width: 1, dash: [8, 4] },
          markerSeries("compaction", "#c62828", "big"),
          markerSeries("background commit", "#7b3fc4", "big"),
          markerSeries("overflow retry", "#e0862b"),
          markerSeries("aborted", "#444444"),
        ],
      }, data, el);
      window.inspectorChart = chart;
    }
  }

  function renderConv(v) {
    $("conv-key").textContent = v.session;
    $("conv-busy").hidden = !v.busy;
    const dl = $("conv-figures");
    dl.replaceChildren();
    figure(dl, "API", v.api || "–");
    figure(dl, "Model", v.model || "–");
    figure(dl, "Session id from", v.id_kind || "–");
    figure(dl, "Window", fmt(v.window));
    figure(dl, "Trigger", fmt(v.threshold_tokens));
    figure(dl, "Last real prompt", fmt(v.last_real_prompt_tokens));
    figure(dl, "Turns", fmt(v.turns));
    figure(dl, "Compactions", fmt(v.compactions));
    figure(dl, "Summary calls", fmt(v.summary_calls));
    figure(dl, "Tokens saved", fmt(v.tokens_saved));
    figure(dl, "Overflow retries", fmt(v.overflow_retries));
    figure(dl, "Silent truncations", fmt(v.truncations));
    figure(dl, "Prefix stable", pct(v.prefix_stable_share));
    figure(dl, "Upstream cache hits", fmt(v.cache_hit_turns) + " of " + fmt(v.usage_reports) + " turns");
    figure(dl, "Cached tokens (all turns)", fmt(v.cached_tokens));
    figure(dl, "Last action", v.last_action || "–");
    if (v.turn_figures) drawChart(v);

    const body = $("compactions").tBodies[0];
    body.replaceChildren();
    for (const c of (v.compaction_figures || []).slice().reverse()) {
      const tr = document.createElement("tr");
      tr.className = "compaction";
      cell(tr, String(c.turn), "num");
      cell(tr, new Date(c.at_ms).toLocaleTimeString());
      cell(tr, c.rows_before + " → " + c.rows_after, "rows");
      cell(tr, fmt(c.tokens_before) + " → " + fmt(c.tokens_after), "tokens");
      cell(tr, c.source === "pending" ? "off the request path" : (c.summariser_ms / 1000).toFixed(2) + " s", "num");
      cell(tr, c.source === "pending" ? "–" : String(c.summary_calls), "num");
      cell(tr, c.fallback ? "yes" : "no", "fallback");
      cell(tr, c.source === "pending" ? "pending pass" : "inline", "source");
      cell(tr, c.strategy);
      body.appendChild(tr);
    }

    const content = v.content;
    $("content").hidden = !content;
    $("content-off").hidden = !!content;
    const cb = $("content-body");
    cb.replaceChildren();
    if (content) {
      $("content-replaced").textContent = "Replaces the client's messages " + content.replaced.from + "–" +
        (content.replaced.to - 1) + " with " + content.replacement_rows + " rows; summary rows " +
        content.summary_rows.join(", ") + ".";
      for (const s of content.summaries) {
        const pre = document.createElement("pre");
        pre.className = "summary";
        pre.textContent = s.text;
        cb.appendChild(pre);
      }
    }
  }

  async function refreshConv(key) {
    renderConv(await getJson(API + "/" + encodeURIComponent(key)));
  }

  async function tick() {
    clearTimeout(timer);
    const m = location.hash.match(/^#\/s\/([0-9a-f]+)$/);
    try {
      if (m) {
        show("conv-view");
        await refreshConv(m[1]);
      } else {
        show("list-view");
        await refreshList();
      }
      $("status").textContent = "updated " + new Date().toLocaleTimeString();
      $("status").classList.remove("error");
    } catch (e) {
      if (e.auth) {
        sessionStorage.removeItem("compactor-admin-token");
        $("login-error").textContent = e.message;
        show("login");
        return;
      }
      $("status").textContent = "error: " + e.message;
      $("status").classList.add("error");
    }
    timer = setTimeout(tick, POLL_MS);
  }

  function start() {
    if (!token()) {
      show("login");
      return;
    }
    tick();
  }

  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("compactor-admin-token", $("token").value);
    $("token").value = "";
    $("login-error").textContent = "";
    start();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem("compactor-admin-token");
    clearTimeout(timer);
    show("login");
  });
  $("filter").addEventListener("input", renderList);
  window.addEventListener("hashchange", () => { if (token()) tick(); });
  start();
})();
