// moe-serve expert-load dashboard: polls /dashboard/data and draws it. No library, nothing loaded from elsewhere.
"use strict";
(function () {
  const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh") || 2000);
  const KEY_ITEM = "moe-serve-api-key";
  const state = { updates: 0, lastError: null, scope: "window", layers: null, experts: 0, data: null, timer: null };
  window.dashboardState = state;  // read by the tests (and handy in the console)
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ the key (only when the server has one)
  if (location.hash.startsWith("#key=")) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(location.hash.slice(5)));
    history.replaceState(null, "", location.pathname + location.search);
  }
  const keyRequired = document.body.dataset.keyRequired === "1";
  function askKey(message) {
    $("keyform").hidden = false;
    setStatus(message, false);
  }
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("key").value.trim());
    $("keyform").hidden = true;
    schedule(0);
  });

  // ------------------------------------------------------------------ helpers
  function setStatus(text, ok) {
    const el = $("status");
    el.textContent = text;
    el.className = "status " + (ok ? "ok" : "err");
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(2) + "M";
    if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(1) + "k";
    return Number(x).toFixed(digits === undefined ? 0 : digits);
  }
  function mix(a, b, t) {
    return [0, 1, 2].map((i) => Math.round(a[i] + (b[i] - a[i]) * t));
  }
  const IDLE = [28, 40, 72], COLD = [60, 110, 190], MEAN = [235, 240, 245], WARM = [245, 150, 90], HOT = [215, 30, 40];
  // load ratio (tokens / the layer's mean per expert) -> colour: blue below the mean, white at it, red above (log2)
  function ratioColor(r) {
    if (!(r > 0)) return IDLE;
    const t = Math.max(-1, Math.min(1, Math.log2(r) / 3));
    if (t < 0) return t > -0.6 ? mix(MEAN, COLD, -t / 0.6) : mix(COLD, IDLE, (-t - 0.6) / 0.4);
    return t < 0.5 ? mix(MEAN, WARM, t / 0.5) : mix(WARM, HOT, (t - 0.5) / 0.5);
  }
  function rgb(c) { return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; }

  // ------------------------------------------------------------------ heatmap (layers x experts)
  function buildHeatmap(layers, experts) {
    const grid = $("heatmap"), rows = $("heat-rows");
    grid.textContent = "";
    rows.textContent = "";
    const h = Math.max(6, Math.min(18, Math.floor(420 / layers.length)));
    grid.style.gridTemplateColumns = "repeat(" + experts + ", minmax(0, 1fr))";
    grid.style.gridAutoRows = h + "px";
    rows.style.gridAutoRows = (h + 1) + "px";
    const frag = document.createDocumentFragment();
    layers.forEach((layer, li) => {
      const label = document.createElement("div");
      label.textContent = layer;
      rows.appendChild(label);
      for (let e = 0; e < experts; e++) {
        const cell = document.createElement("div");
        cell.className = "cell";
        cell.dataset.layer = layer;
        cell.dataset.expert = e;
        cell.dataset.count = "0";
        frag.appendChild(cell);
      }
    });
    grid.appendChild(frag);
    grid.onmouseover = (ev) => {
      const c = ev.target;
      if (!c.classList || !c.classList.contains("cell")) return;
      $("hover").textContent = "layer " + c.dataset.layer + ", expert " + c.dataset.expert + ": " +
        Number(c.dataset.count).toLocaleString() + " tokens (" + c.dataset.ratio + "x the layer's mean)";
    };
    state.layers = layers.slice();
    state.experts = experts;
  }
  function drawHeatmap(counts) {
    const cells = $("heatmap").children;
    const E = state.experts;
    counts.forEach((row, li) => {
      const total = row.reduce((a, b) => a + b, 0);
      const mean = total / E;
      for (let e = 0; e < E; e++) {
        const cell = cells[li * E + e];
        const r = mean > 0 ? row[e] / mean : 0;
        cell.style.backgroundColor = rgb(ratioColor(r));
        cell.dataset.count = row[e];
        cell.dataset.ratio = r.toFixed(2);
      }
    });
  }

  // ------------------------------------------------------------------ per-layer table
  function drawTable(layers, stats, topK, E) {
    const body = $("layer-table").tBodies[0];
    const maxImb = Math.max(1.0001, E / Math.max(1, topK));
    const html = layers.map((layer, i) => {
      const imb = stats.imbalance[i];
      const w = Math.round(60 * Math.max(0, Math.min(1, (imb - 1) / (maxImb - 1))));
      return "<tr><td>" + layer + "</td><td><span class=\"bar\" style=\"width:" + w + "px\"></span>" +
        fmt(imb, 2) + "</td><td>" + fmt(stats.entropy[i], 3) + "</td><td>" +
        fmt(100 * stats.top10_share[i], 1) + "%</td></tr>";
    });
    body.innerHTML = html.join("");
  }

  // ------------------------------------------------------------------ time charts
  function lineChart(svg, series, x0, x1, yMax) {
    const W = 600, H = Number(svg.viewBox.baseVal.height) || 160;
    const ymax = Math.max(yMax || 0, ...series.flatMap((s) => s.map((p) => p[1])), 1e-9);
    const sx = (t) => ((t - x0) / Math.max(1e-9, x1 - x0)) * W;
    const sy = (v) => H - 4 - (v / ymax) * (H - 12);
    let out = "<line class=\"axis\" x1=\"0\" y1=\"" + (H - 4) + "\" x2=\"" + W + "\" y2=\"" + (H - 4) + "\"/>";
    series.forEach((s, i) => {
      if (!s.length) return;
      const pts = s.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
      out += "<polyline class=\"s" + (i + 1) + "\" points=\"" + pts + "\"/>";
    });
    svg.innerHTML = out;
    svg.dataset.ymax = ymax;
    const label = $(svg.id + "-max");
    if (label) label.textContent = "top of the axis: " + fmt(ymax, ymax < 10 ? 2 : 0);
    return ymax;
  }
  function drawStrip(canvas, timeline, nLayers) {
    const n = timeline.length;
    canvas.width = Math.max(1, n);
    canvas.height = Math.max(1, nLayers);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(canvas.width, canvas.height);
    timeline.forEach((p, x) => {
      (p.imbalance || []).forEach((v, y) => {
        const c = p.tokens > 0 ? mix(MEAN, HOT, Math.max(0, Math.min(1, (v - 1) / 3))) : IDLE;
        const o = 4 * (y * canvas.width + x);
        img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
      });
    });
    ctx.putImageData(img, 0, 0);
  }
  function drawCharts(d) {
    const tl = d.timeline || [];
    const x1 = d.now, x0 = d.now - d.window_seconds;
    const tput = [tl.map((p) => [p.t, p.tokens / p.dt]), tl.map((p) => [p.t, p.sampled / p.dt])];
    lineChart($("tput"), tput, x0, x1);
    lineChart($("kv"), [tl.map((p) => [p.t, 100 * (p.kv_cache_usage || 0)])], x0, x1, 100);
    const prefix = [];
    for (let i = 1; i < tl.length; i++) {
      const q = tl[i].prefix_cache_queries - tl[i - 1].prefix_cache_queries;
      if (q > 0) prefix.push([tl[i].t, 100 * (tl[i].prefix_cache_hits - tl[i - 1].prefix_cache_hits) / q]);
    }
    lineChart($("prefix"), [prefix], x0, x1, 100);
    const busy = tl.filter((p) => p.tokens > 0);
    const maxLine = busy.map((p) => [p.t, Math.max(...p.imbalance)]);
    const meanLine = busy.map((p) => [p.t, p.imbalance.reduce((a, b) => a + b, 0) / p.imbalance.length]);
    lineChart($("imb-lines"), [maxLine, meanLine], x0, x1);
    drawStrip($("imb-strip"), tl, (d.layers || []).length);
  }

  // ------------------------------------------------------------------ cards
  function rate(tl, key, seconds) {
    let n = 0, dt = 0;
    const now = tl.length ? tl[tl.length - 1].t : 0;
    for (let i = tl.length - 1; i >= 0 && now - tl[i].t < seconds; i--) { n += tl[i][key]; dt += tl[i].dt; }
    return dt > 0 ? n / dt : 0;
  }
  function drawCards(d) {
    const s = d.stats || {}, tl = d.timeline || [];
    const fresh = tl.length && d.now - tl[tl.length - 1].t < 3 * (d.interval_seconds || 1);
    $("c-forwarded").textContent = fresh ? fmt(rate(tl, "tokens", 5)) : "0";
    $("c-generated").textContent = fresh ? fmt(rate(tl, "sampled", 5)) : "0";
    $("c-kv").textContent = s.kv_cache_usage !== undefined ? fmt(100 * s.kv_cache_usage, 1) + "%" : "–";
    if (tl.length > 1) {
      const q = tl[tl.length - 1].prefix_cache_queries - tl[0].prefix_cache_queries;
      const h = tl[tl.length - 1].prefix_cache_hits - tl[0].prefix_cache_hits;
      $("c-prefix").textContent = q > 0 ? fmt(100 * h / q, 1) + "%" : "–";
    }
    $("c-requests").textContent = (s.running === undefined ? "–" : s.running) + " / " +
      (s.waiting === undefined ? "–" : s.waiting);
    if (d.enabled) {
      $("c-total").textContent = fmt(d.total.tokens);
      const busy = d.window.imbalance.filter((v) => v > 0);
      $("c-imbalance").textContent = busy.length ? fmt(busy.reduce((a, b) => a + b, 0) / busy.length, 2) : "–";
      $("c-recorder").textContent = d.recording ? "recording" : "idle";
    }
  }

  // ------------------------------------------------------------------ one refresh
  function render(d) {
    const m = d.model || {};
    $("model").textContent = (m.name || "") + " · " + (m.architecture || "") + " · " +
      (m.moe_layers ? m.moe_layers.length : "?") + " MoE layers × " + (m.num_experts || "?") + " experts, top-" +
      (m.top_k || "?") + (d.weight_version ? " · weights " + d.weight_version : "");
    drawCards(d);
    if (!d.enabled) {
      $("notice").hidden = false;
      $("notice").textContent = d.message || "expert load counting is off";
      return;
    }
    $("notice").hidden = true;
    if (!state.layers || state.layers.join() !== d.layers.join() || state.experts !== d.num_experts) {
      buildHeatmap(d.layers, d.num_experts);
    }
    const scope = state.scope === "total" ? d.total : d.window;
    $("heat-title").textContent = state.scope === "total"
      ? "Expert load since start (" + fmt(d.total.tokens) + " tokens)"
      : "Expert load, last " + fmt(d.window_seconds) + " s (" + fmt(d.window.tokens) + " tokens)";
    $("heat-note").textContent = "colour: an expert's tokens / its layer's mean";
    drawHeatmap(scope.counts);
    drawTable(d.layers, scope, d.top_k, d.num_experts);
    drawCharts(d);
  }

  async function refresh() {
    const key = sessionStorage.getItem(KEY_ITEM);
    if (keyRequired && !key) { askKey("an API key is needed"); return; }
    const ctl = new AbortController();
    const timeout = setTimeout(() => ctl.abort(), 10000);
    try {
      const r = await fetch("/dashboard/data", { headers: key ? { Authorization: "Bearer " + key } : {},
                                                 signal: ctl.signal, cache: "no-store" });
      if (r.status === 401) { sessionStorage.removeItem(KEY_ITEM); askKey("the API key was refused"); return; }
      const d = await r.json();
      if (!r.ok) throw new Error((d.error && d.error.message) || ("HTTP " + r.status));
      state.data = d;
      render(d);
      state.updates += 1;
      state.lastError = null;
      document.body.dataset.updates = state.updates;
      setStatus("live · updated " + new Date().toLocaleTimeString(), true);
    } catch (err) {
      state.lastError = String(err && err.message || err);
      setStatus("no data: " + state.lastError, false);
    } finally {
      clearTimeout(timeout);
    }
    schedule(REFRESH_MS);
  }
  function schedule(ms) {
    clearTimeout(state.timer);
    state.timer = setTimeout(refresh, ms);
  }
  document.querySelectorAll("input[name=scope]").forEach((el) => el.addEventListener("change", () => {
    state.scope = el.value;
    if (state.data) render(state.data);
  }));
  schedule(0);
})();
