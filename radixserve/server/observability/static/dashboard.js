// The cache dashboard: polls /v1/cache/stats about once a second and draws it with plain SVG.
// Server data (prompt text above all) only ever enters the page through textContent and
// setAttribute, never as markup, and the page's Content-Security-Policy forbids inline scripts.
"use strict";

(() => {
  const KEY_STORAGE = "radixserve.apiKey";
  const POLL_MS = 1000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const POOL_STATES = [
    ["private", "#2ca02c"], ["pinned", "#9467bd"], ["protected", "#ff7f0e"],
    ["evictable", "#1f77b4"], ["free", "#d9dde3"],
  ];
  // Tree nodes open by default down to this depth; a click overrides it per node.
  const OPEN_DEPTH = 1;

  const state = {
    window: "5m",
    inFlight: false,
    again: false,
    timer: 0,
    stats: null,
    expanded: new Map(), // tree node key -> open?
  };

  const $ = (id) => document.getElementById(id);

  // An HTML element with attributes and children (strings become text nodes).
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== undefined && value !== null) node.setAttribute(name, String(value));
    }
    node.append(...children.map((c) => (typeof c === "string" ? document.createTextNode(c) : c)));
    return node;
  }

  function svg(tag, attrs = {}) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    return node;
  }

  // ---- formatting -------------------------------------------------------------------------

  const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtPct = (x) => (x == null || Number.isNaN(x) ? "–" : `${(100 * x).toFixed(1)}%`);

  function fmtUsd(v) {
    if (v == null) return "–";
    const a = Math.abs(v);
    if (a === 0) return "$0";
    return "$" + v.toFixed(a < 0.01 ? 6 : a < 1 ? 4 : 2);
  }

  function fmtSeconds(s) {
    if (s == null) return "–";
    return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
  }

  function fmtDuration(s) {
    if (s == null) return "–";
    if (s < 60) return `${Math.round(s)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  // Edge text on one line: newlines and tabs shown as symbols.
  const oneLine = (text) => String(text ?? "").replace(/\n/g, "⏎").replace(/\t/g, "⇥");

  // A figure's text for people and its raw value (data-value) for tests and scripts.
  function setFigure(id, value, text) {
    const node = $(id);
    node.textContent = text;
    node.dataset.value = value == null ? "" : String(value);
  }

  const sum = (xs) => xs.reduce((a, x) => a + (x ?? 0), 0);
  const lastValue = (xs) => {
    for (let i = xs.length - 1; i >= 0; i--) if (xs[i] != null) return xs[i];
    return null;
  };

  // ---- polling and the key ----------------------------------------------------------------

  function setStatus(kind, text) {
    const node = $("status");
    node.dataset.state = kind;
    node.textContent = text;
  }

  function schedule(delay = POLL_MS) {
    clearTimeout(state.timer);
    state.timer = setTimeout(poll, delay);
  }

  async function poll() {
    if (state.inFlight) {
      state.again = true;
      return;
    }
    clearTimeout(state.timer);
    state.inFlight = true;
    const key = sessionStorage.getItem(KEY_STORAGE);
    try {
      const response = await fetch(`/v1/cache/stats?window=${state.window}`, {
        headers: key ? { Authorization: `Bearer ${key}` } : {},
        cache: "no-store",
      });
      if (response.status === 401) {
        askForKey(key ? "The server rejected this key." : "");
        return;
      }
      if (!response.ok) {
        setStatus("error", `stats answered HTTP ${response.status}; retrying`);
      } else {
        render(await response.json());
        setStatus("live", "live");
      }
      schedule(state.again ? 0 : POLL_MS);
    } catch (err) {
      setStatus("error", "server unreachable; retrying");
      console.error(err);
      schedule();
    } finally {
      state.inFlight = false;
      state.again = false;
    }
  }

  function askForKey(message) {
    clearTimeout(state.timer);
    sessionStorage.removeItem(KEY_STORAGE);
    $("forget-key").hidden = true;
    $("key-error").textContent = message;
    $("key-form").hidden = false;
    setStatus("auth", "API key needed");
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("key-input").value = "";
    $("key-form").hidden = true;
    $("forget-key").hidden = false;
    setStatus("connecting", "connecting…");
    poll();
  });

  $("forget-key").addEventListener("click", () => askForKey(""));

  for (const button of document.querySelectorAll(".switch button")) {
    button.addEventListener("click", () => {
      state.window = button.dataset.window;
      for (const b of document.querySelectorAll(".switch button")) {
        b.setAttribute("aria-pressed", String(b === button));
      }
      if ($("key-form").hidden) poll();
    });
  }

  // ---- rendering --------------------------------------------------------------------------

  function render(stats) {
    state.stats = stats;
    $("model").textContent = stats.model ?? "";
    $("uptime").textContent = fmtDuration(stats.uptime_s);
    // Each part draws on its own: a field missing from one does not blank the others.
    for (const part of [renderFigures, renderCharts, renderMoney, renderTenants, renderTree,
                        renderRecent]) {
      try {
        part(stats);
      } catch (err) {
        console.error(part.name, err);
      }
    }
    document.body.dataset.statsNow = String(stats.now);
  }

  function renderFigures(stats) {
    const totals = stats.totals ?? {};
    const series = stats.series ?? {};
    setFigure("hit-rate", totals.hit_rate, fmtPct(totals.hit_rate));
    const prompt = sum(series.prompt_tokens ?? []);
    const windowRate = prompt > 0 ? sum(series.cached_tokens ?? []) / prompt : null;
    setFigure("hit-rate-window", windowRate, fmtPct(windowRate));

    // Requests/s over the last 10 s (5 min window) or 5 min (1 h window).
    const interval = series.interval_s || 1;
    const requests = series.requests ?? [];
    const buckets = Math.max(1, Math.min(requests.length, Math.round((interval === 1 ? 10 : 300) / interval)));
    const rate = requests.length ? sum(requests.slice(-buckets)) / (buckets * interval) : null;
    setFigure("requests-per-s", rate, rate == null ? "–" : rate.toFixed(2));
    setFigure("requests-total", totals.requests, fmtInt(totals.requests));

    const p50 = lastValue(series.ttft_p50_s ?? []);
    const p99 = lastValue(series.ttft_p99_s ?? []);
    setFigure("ttft-p50", p50, fmtSeconds(p50));
    setFigure("ttft-p99", p99, fmtSeconds(p99));
    setFigure("cached-tokens", totals.cached_tokens, fmtInt(totals.cached_tokens));
    setFigure("computed-tokens", totals.computed_prompt_tokens, fmtInt(totals.computed_prompt_tokens));

    const cost = stats.cost ?? {};
    setFigure("saved-usd", cost.saved_usd, fmtUsd(cost.saved_usd));
    setFigure("saved-usd-per-hour", cost.saved_usd_per_hour, fmtUsd(cost.saved_usd_per_hour));

    const pool = stats.pool ?? {};
    // As vLLM's kv_cache_usage_perc counts it: cached but unlocked KV is reclaimable.
    const used = pool.total != null
      ? pool.total - (pool.free ?? 0) - (pool.evictable ?? 0) : null;
    setFigure("pool-used", used, used == null || !pool.total ? "–" : fmtPct(used / pool.total));
    setFigure("pool-total", pool.total, fmtInt(pool.total));

    // Speculative decoding: accepted / drafted tokens since start ("–" before any draft).
    const spec = stats.speculation ?? {};
    const accepted = spec.draft_tokens ? spec.acceptance_rate : null;
    setFigure("spec-acceptance", accepted, fmtPct(accepted));
    setFigure("spec-accepted", spec.accepted_tokens, fmtInt(spec.accepted_tokens));
    setFigure("spec-drafted", spec.draft_tokens, fmtInt(spec.draft_tokens));
    $("spec-mode").textContent = spec.mode ? `server default ${spec.mode}` : "–";
  }

  function renderCharts(stats) {
    const series = stats.series ?? {};
    const t = series.t ?? [];
    const interval = series.interval_s || 1;
    const axis = { t, interval };
    const requests = series.requests ?? [];
    const prompt = series.prompt_tokens ?? [];
    const cached = series.cached_tokens ?? [];

    drawChart($("chart-hit-rate"), {
      ...axis, kind: "line", yMax: 100, format: (v) => `${v}%`,
      layers: [{ name: "hit rate", color: "#1f77b4",
                 values: (series.hit_rate ?? []).map((x) => (x == null ? null : 100 * x)) }],
    });
    drawChart($("chart-requests"), {
      ...axis, kind: "bars", format: (v) => String(v),
      layers: [{ name: "requests/s", color: "#1f77b4", values: requests.map((n) => n / interval) }],
    });
    const ttft = [
      { name: "p50", color: "#1f77b4", values: (series.ttft_p50_s ?? []).map(toMs) },
      { name: "p99", color: "#d62728", values: (series.ttft_p99_s ?? []).map(toMs) },
    ];
    drawChart($("chart-ttft"), { ...axis, kind: "line", format: (v) => `${v} ms`, layers: ttft });
    legend($("legend-ttft"), ttft.map((l) => [l.name, l.color, null]));

    const tokens = [
      { name: "cached", color: "#2ca02c", values: cached },
      { name: "computed", color: "#ff7f0e",
        values: prompt.map((p, i) => Math.max(0, (p ?? 0) - (cached[i] ?? 0))) },
    ];
    drawChart($("chart-tokens"), { ...axis, kind: "bars", format: compact, layers: tokens });
    legend($("legend-tokens"), tokens.map((l) => [l.name, l.color, null]));

    const pool = stats.pool ?? {};
    const poolSeries = series.pool ?? {};
    const layers = POOL_STATES.map(([name, color]) => ({
      name, color, values: poolSeries[name] ?? [],
    }));
    const chart = $("chart-pool");
    drawChart(chart, {
      ...axis, kind: "area", yMax: pool.total || undefined, capacity: pool.total,
      format: compact, layers,
    });
    chart.dataset.total = String(pool.total ?? "");
    legend($("legend-pool"), [...POOL_STATES].reverse().map(
      ([name, color]) => [name, color, pool[name]]).concat([["capacity", "#333", pool.total]]),
      "pool-");
  }

  const toMs = (s) => (s == null ? null : s * 1000);
  const compact = (v) => (v >= 1e6 ? `${+(v / 1e6).toFixed(1)}M` : v >= 1e3 ? `${+(v / 1e3).toFixed(1)}k` : String(v));

  // Swatches with names and, where given, the current value (data-testid prefix + name).
  function legend(node, entries, testPrefix) {
    node.replaceChildren(...entries.map(([name, color, value]) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = color;
      const item = el("span", { class: "item" }, swatch, name);
      if (value !== null) {
        item.append(" ", el("strong", {
          "data-testid": testPrefix ? testPrefix + name : undefined,
          "data-value": value ?? "",
        }, fmtInt(value)));
      }
      return item;
    }));
  }

  // A round upper bound for an axis: 1, 2 or 5 times a power of ten.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // Draws `layers` over time into `node`: "line" (nulls leave gaps), or stacked "bars" or
  // "area" (first layer at the bottom), with an optional dashed capacity line.
  function drawChart(node, { t, interval, kind, layers, yMax, format, capacity }) {
    const width = node.clientWidth || 400;
    const height = node.clientHeight || 150;
    const m = { left: 48, right: 8, top: 8, bottom: 20 };
    const plotW = width - m.left - m.right;
    const plotH = height - m.top - m.bottom;
    node.setAttribute("viewBox", `0 0 ${width} ${height}`);
    node.replaceChildren();
    const n = t.length;
    node.dataset.points = String(n);

    const stacked = kind !== "line";
    const tops = [];
    let maxSeen = 0;
    for (let i = 0; i < n; i++) {
      let total = 0;
      for (const layer of layers) {
        const v = layer.values[i];
        if (stacked) total += v ?? 0;
        else if (v != null) total = Math.max(total, v);
      }
      tops.push(total);
      maxSeen = Math.max(maxSeen, total);
    }
    const top = yMax ?? niceMax(maxSeen);
    const slot = n ? plotW / n : plotW;
    const x = (i) => m.left + (i + 0.5) * slot;
    const y = (v) => m.top + plotH - (Math.min(v, top) / top) * plotH;

    // Grid and labels.
    for (const frac of [0, 0.5, 1]) {
      const v = top * frac;
      node.append(svg("line", { x1: m.left, x2: width - m.right, y1: y(v), y2: y(v), class: "grid" }));
      const label = svg("text", { x: m.left - 4, y: y(v) + 4, "text-anchor": "end", class: "tick" });
      label.textContent = format(Number.isInteger(v) ? v : +v.toFixed(2));
      node.append(label);
    }
    if (n) {
      // Ticks on whole minutes back from the newest bucket: every 1 min (5 min) or 15 (1 h).
      const step = n * interval <= 600 ? 60 : 900;
      for (let back = 0; back < n * interval; back += step) {
        const i = n - 1 - Math.round(back / interval);
        const label = svg("text", { x: x(i), y: height - 5, "text-anchor": "middle", class: "tick" });
        label.textContent = back ? `-${back / 60} min` : "now";
        node.append(label);
      }
    } else {
      const label = svg("text", { x: m.left + plotW / 2, y: m.top + plotH / 2, "text-anchor": "middle", class: "tick" });
      label.textContent = "no data yet";
      node.append(label);
    }

    if (kind === "line") {
      for (const layer of layers) {
        let d = "";
        let penDown = false;
        layer.values.forEach((v, i) => {
          if (v == null) { penDown = false; return; }
          d += `${penDown ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
          penDown = true;
        });
        node.append(svg("path", { d, fill: "none", stroke: layer.color, "stroke-width": 1.8,
                                  "data-layer": layer.name }));
        // Lone points (a bucket between two gaps) as dots, or they would not show.
        layer.values.forEach((v, i) => {
          if (v != null && layer.values[i - 1] == null && layer.values[i + 1] == null) {
            node.append(svg("circle", { cx: x(i), cy: y(v), r: 2, fill: layer.color }));
          }
        });
      }
    } else if (kind === "bars") {
      const below = new Array(n).fill(0);
      for (const layer of layers) {
        let d = "";
        for (let i = 0; i < n; i++) {
          const v = layer.values[i] ?? 0;
          if (v > 0) {
            const y0 = y(below[i]);
            const y1 = y(below[i] + v);
            d += `M${(x(i) - slot * 0.4).toFixed(1)},${y0.toFixed(1)}h${(slot * 0.8).toFixed(1)}V${y1.toFixed(1)}h${(-slot * 0.8).toFixed(1)}Z`;
          }
          below[i] += v;
        }
        node.append(svg("path", { d, fill: layer.color, "data-layer": layer.name }));
      }
    } else {
      // One band per layer over each run of sampled buckets (a bucket before the server started
      // or between samples is a gap), stretched half a bucket each way so a lone sample shows.
      const sampled = t.map((_, i) => layers.every((layer) => layer.values[i] != null));
      const runs = [];
      for (let i = 0; i < n; i++) {
        if (!sampled[i]) continue;
        if (i > 0 && sampled[i - 1]) runs[runs.length - 1][1] = i;
        else runs.push([i, i]);
      }
      const below = new Array(n).fill(0);
      for (const layer of layers) {
        const above = below.map((b, i) => b + (layer.values[i] ?? 0));
        let d = "";
        for (const [first, last] of runs) {
          const edge = (values) => {
            const points = [[x(first) - slot / 2, values[first]]];
            for (let i = first; i <= last; i++) points.push([x(i), values[i]]);
            points.push([x(last) + slot / 2, values[last]]);
            return points;
          };
          d += [...edge(above), ...edge(below).reverse()]
            .map(([px, v], k) => `${k ? "L" : "M"}${px.toFixed(1)},${y(v).toFixed(1)}`).join("") + "Z";
        }
        node.append(svg("path", { d, fill: layer.color, "data-layer": layer.name }));
        below.splice(0, n, ...above);
      }
    }
    if (capacity != null) {
      node.append(svg("line", { x1: m.left, x2: width - m.right, y1: y(capacity), y2: y(capacity),
                                class: "capacity", "data-layer": "capacity" }));
    }
  }

  function renderMoney(stats) {
    const cost = stats.cost ?? {};
    $("price-profile").textContent = cost.profile ?? "–";
    setFigure("cost-with", cost.with_cache_usd, fmtUsd(cost.with_cache_usd));
    setFigure("cost-without", cost.without_cache_usd, fmtUsd(cost.without_cache_usd));
    setFigure("cost-saved", cost.saved_usd, fmtUsd(cost.saved_usd));
    setFigure("cost-saved-per-hour", cost.saved_usd_per_hour, fmtUsd(cost.saved_usd_per_hour));
    const most = Math.max(cost.with_cache_usd ?? 0, cost.without_cache_usd ?? 0);
    $("bar-with").style.width = most > 0 ? `${(100 * cost.with_cache_usd) / most}%` : "0";
    $("bar-without").style.width = most > 0 ? `${(100 * cost.without_cache_usd) / most}%` : "0";
  }

  function renderTenants(stats) {
    const rows = (stats.tenants ?? []).map((tenant) => el("tr", { "data-testid": "tenant-row" },
      el("td", {}, el("code", {}, String(tenant.namespace))),
      el("td", { class: "num" }, fmtInt(tenant.requests)),
      el("td", { class: "num" }, fmtInt(tenant.prompt_tokens)),
      el("td", { class: "num" }, fmtInt(tenant.cached_tokens)),
      el("td", { class: "num" }, fmtPct(tenant.hit_rate)),
      el("td", { class: "num" }, fmtInt(tenant.tokens_saved))));
    $("tenants-body").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No requests yet."))]));
  }

  // ---- the radix tree ---------------------------------------------------------------------

  function renderTree(stats) {
    const tree = stats.tree ?? { roots: [] };
    const roots = tree.roots ?? [];
    const summary = `${fmtInt(tree.shown)} of ${fmtInt(tree.nodes)} nodes shown` +
      (tree.truncated ? " (capped)" : "");
    $("tree-summary").textContent = summary;
    const items = roots.map((node) => treeItem(node, "", 0));
    $("tree").replaceChildren(...(items.length ? items
      : [el("li", { class: "muted" }, "No cached prefixes yet (or this cache mode keeps no tree).")]));
  }

  // Keys survive polls without relying on node ids: siblings differ in their first token.
  const nodeKey = (node, parentKey) => `${parentKey}\u0000${node.namespace}\u0001${node.text}`;

  function treeItem(node, parentKey, depth) {
    const key = nodeKey(node, parentKey);
    const children = node.children ?? [];
    const open = children.length > 0 && (state.expanded.get(key) ?? depth < OPEN_DEPTH);
    const item = el("li", {
      role: "treeitem",
      "data-testid": "tree-node",
      "data-node-id": node.id,
      "data-tokens": node.tokens,
      "data-hits": node.hits,
      "aria-expanded": children.length ? String(open) : undefined,
    });
    const toggle = el("button", {
      type: "button", class: "toggle", "aria-label": open ? "collapse" : "expand",
      disabled: children.length ? undefined : "",
    }, children.length ? (open ? "▾" : "▸") : "·");
    toggle.addEventListener("click", () => {
      state.expanded.set(key, !open);
      renderTree(state.stats);
    });
    const edge = el("code", { class: "edge", "data-testid": "tree-text", title: node.text ?? "" },
      oneLine(node.text));
    const label = el("span", { class: "label" }, toggle, edge);
    label.style.paddingLeft = `${depth * 16}px`;
    const row = el("div", { class: "node-row" }, label,
      el("span", { class: "num" }, fmtInt(node.tokens)),
      el("span", { class: "num" }, fmtInt(node.hits)),
      el("span", { class: "num" }, fmtInt(node.served_tokens)),
      el("span", { class: "num" }, node.last_used_s_ago == null ? "–" : `${fmtDuration(node.last_used_s_ago)} ago`),
      el("span", { class: node.locks ? "num locked" : "num" }, fmtInt(node.locks)),
      el("span", { class: node.pinned_for_s != null ? "num pinned" : "num" },
        node.pinned_for_s == null ? "–" : fmtDuration(node.pinned_for_s)),
      el("span", { class: "ns" }, String(node.namespace ?? "")));
    item.append(row);
    if (open) {
      item.append(el("ul", { role: "group" }, ...children.map((c) => treeItem(c, key, depth + 1))));
    }
    return item;
  }

  // ---- recent requests --------------------------------------------------------------------

  function renderRecent(stats) {
    const recent = [...(stats.recent ?? [])].sort((a, b) => b.at - a.at);
    const rows = recent.map((r) => el("tr", { "data-testid": "recent-row", "data-request-id": r.id },
      el("td", {}, `${fmtDuration(Math.max(0, stats.now - r.at))} ago`),
      el("td", {}, String(r.api ?? "")),
      el("td", { class: "num" }, fmtInt(r.prompt_tokens)),
      el("td", { class: "num" }, fmtInt(r.cached_tokens)),
      el("td", { class: "num" }, fmtSeconds(r.ttft_s)),
      el("td", { class: "num" }, fmtUsd(r.cost_usd)),
      el("td", { class: "num" }, r.miss_at == null ? "all cached" : `token ${fmtInt(r.miss_at)}`),
      el("td", {}, el("code", { class: "edge", title: r.miss_text ?? "" }, oneLine(r.miss_text)),
        // What the server changed before the engine saw the prompt (a preamble stripped).
        ...(r.notes ?? []).map((note) => el("div", { class: "muted", "data-testid": "recent-note" },
                                            note)))));
    $("recent-body").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No requests yet."))]));
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && $("key-form").hidden) poll();
  });
  window.addEventListener("resize", () => state.stats && renderCharts(state.stats));

  poll();
})();
