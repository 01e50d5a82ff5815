// tidegate's live dashboard: polls dashboard/data and draws it (SVG, no library).
//
// A snapshot holds cumulative counters and histogram buckets, as /metrics does. Rates and
// quantiles come from the newest snapshot against the oldest one kept within window_s,
// computed as Prometheus' rate() and histogram_quantile() do. Every number cell carries its
// unrounded value in data-value; <body> says which two snapshots (data-from-at, data-to-at)
// the numbers on the page come from.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2f6fde", "#d9480f", "#2b8a3e", "#ae3ec9", "#e8590c", "#0b7285",
                   "#c2255c", "#5f3dc4", "#868e96", "#a08400"];
  // HTTP status of each terminal outcome (gateway/forward.py outcome_of).
  const STATUS_OF = {
    completed: "200", shed: "429", rejected_full: "429", rejected_deadline: "429",
    rejected_holdback: "429", rejected_unavailable: "503", shutdown: "503",
    expired: "504", failed: "502", cancelled: "499", invalid: "4xx",
  };
  const STATUSES = ["200", "429", "503", "504", "502", "499", "4xx", "other"];
  const QUANTILES = [0.5, 0.95, 0.99];

  const snaps = [];       // recent snapshots, oldest first, spanning window_s
  const history = [];     // derived points for the charts: {at, values: {series: number}}
  const replicaSeries = new Set();  // every replicas:model/pool/state line drawn so far
  let polls = 0;

  // ------------------------------------------------------------ samples and PromQL-alikes
  function matches(labels, match) {
    for (const key in match) if (labels[key] !== match[key]) return false;
    return true;
  }
  function total(samples, name, match) {
    let sum = 0, found = false;
    for (const [n, labels, value] of samples || []) {
      if (n === name && matches(labels, match)) { sum += value; found = true; }
    }
    return found ? sum : null;
  }
  function increase(before, after) {  // a counter that went down was reset (a restart)
    if (after === null) return null;
    if (before === null) return after;
    return after >= before ? after - before : after;
  }
  function buckets(samples, name, match) {  // le -> cumulative count, summed over the rest
    const out = new Map();
    for (const [n, labels, value] of samples || []) {
      if (n !== name + "_bucket" || !matches(labels, match)) continue;
      const le = labels.le === "+Inf" ? Infinity : Number(labels.le);
      out.set(le, (out.get(le) || 0) + value);
    }
    return out;
  }
  function bucketIncrease(before, after) {
    return [...after.keys()].sort((a, b) => a - b)
      .map((le) => [le, increase(before.has(le) ? before.get(le) : null, after.get(le))]);
  }
  // Prometheus' histogram_quantile over [[le, cumulative count]...] sorted by le.
  function quantile(q, cumulative) {
    const n = cumulative.length;
    if (n < 2 || cumulative[n - 1][0] !== Infinity) return NaN;
    const observations = cumulative[n - 1][1];
    if (!(observations > 0)) return NaN;
    let rank = q * observations;
    let b = cumulative.findIndex(([, count]) => count >= rank);
    if (b === n - 1) return cumulative[n - 2][0];
    if (b === 0 && cumulative[0][0] <= 0) return cumulative[0][0];
    let start = 0, count = cumulative[b][1];
    const end = cumulative[b][0];
    if (b > 0) {
      start = cumulative[b - 1][0];
      count -= cumulative[b - 1][1];
      rank -= cumulative[b - 1][1];
    }
    return start + (end - start) * (rank / count);
  }

  // ------------------------------------------------------------------ formatting and DOM
  function fmt(value, digits = 3) {
    if (value === null || value === undefined) return "n/a";
    if (Number.isNaN(value)) return "–";
    if (value === 0) return "0";
    const abs = Math.abs(value);
    if (abs >= 1000) return Math.round(value).toLocaleString("en-US");
    return Number(value.toPrecision(digits)).toString();
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const key in attrs || {}) node.setAttribute(key, attrs[key]);
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const key in attrs || {}) node.setAttribute(key, attrs[key]);
    for (const child of children) node.append(child);
    return node;
  }
  // A number cell: its text, and the unrounded value for whoever checks it.
  function num(key, value, digits) {
    const absent = value === null || value === undefined || Number.isNaN(value);
    const cell = el("td", {"data-k": key, "data-value": absent ? "" : String(value)},
                    fmt(value, digits));
    if (value === null || value === undefined) cell.className = "na";
    return cell;
  }
  function text(value, cls) { return el("td", {class: cls ? "text " + cls : "text"}, value); }
  function table(id, head, rows) {
    const node = document.getElementById(id);
    node.replaceChildren(el("tr", {}, ...head.map((h) => el("th", {}, h))), ...rows);
  }
  function clock(at) { return new Date(at * 1000).toLocaleTimeString("en-GB"); }

  // ----------------------------------------------------------------------------- charts
  // series: [{name, points: [[at, value]...]}]; markers: [{at, direction, label, title}]
  // Drawn at the container's own width: its text stays 10 px whatever the layout.
  function widthOf(node, fallback) { return Math.max(240, node.clientWidth || fallback); }
  function lineChart(id, series, from, to, markers = []) {
    const container = document.getElementById(id);
    const W = widthOf(container, 600), H = 170, L = 44, R = 12, T = 8, B = 20;
    let max = 0;
    for (const s of series) for (const [, v] of s.points) if (Number.isFinite(v)) max = Math.max(max, v);
    max = niceCeiling(max);
    const x = (at) => L + (W - L - R) * (to > from ? (at - from) / (to - from) : 1);
    const y = (v) => T + (H - T - B) * (1 - v / max);
    const chart = svg("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img"});
    for (const v of [0, max / 2, max]) {
      chart.append(svg("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}),
                   svg("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end"}, fmt(v, 2)));
    }
    for (const [at, anchor] of [[from, "start"], [(from + to) / 2, "middle"], [to, "end"]]) {
      chart.append(svg("text", {x: x(at), y: H - 5, "text-anchor": anchor}, clock(at)));
    }
    for (const m of markers) {
      if (m.at < from || m.at > to) continue;
      chart.append(svg("g", {class: "scale-event", "data-direction": m.direction,
                             "data-at": String(m.at)},
        svg("title", {}, m.title),
        svg("line", {x1: x(m.at), x2: x(m.at), y1: T, y2: H - B}),
        svg("text", {x: x(m.at) + 2, y: T + 9}, m.label)));
    }
    const legend = el("div", {class: "legend"});
    series.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      const finite = s.points.filter(([, v]) => Number.isFinite(v));
      if (finite.length) {
        chart.append(svg("polyline", {stroke: color,
          points: finite.map(([at, v]) => `${x(at).toFixed(1)},${y(v).toFixed(1)}`).join(" ")}));
        const [at, v] = finite[finite.length - 1];
        chart.append(svg("circle", {cx: x(at), cy: y(v), r: 2.5, fill: color,
                                    "data-series": s.name, "data-value": String(v)}));
      }
      const last = s.points.length ? s.points[s.points.length - 1][1] : NaN;
      legend.append(el("span", {style: `--swatch:${color}`, "data-series": s.name},
                       `${s.name} ${fmt(last)}`));
    });
    container.replaceChildren(chart, legend);
  }
  function niceCeiling(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }
  function barChart(title, bars, width) {  // bars: [{label, value}]
    const W = width, H = 150, L = 34, B = 20, T = 8;
    const max = niceCeiling(Math.max(0, ...bars.map((b) => b.value)));
    const step = Math.min(90, (W - L - 4) / Math.max(1, bars.length));
    const chart = svg("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img"});
    for (const v of [0, max]) {
      const yy = T + (H - T - B) * (1 - v / max);
      chart.append(svg("line", {class: "grid", x1: L, x2: W - 4, y1: yy, y2: yy}),
                   svg("text", {x: L - 4, y: yy + 3, "text-anchor": "end"}, fmt(v, 2)));
    }
    bars.forEach((b, i) => {
      const h = (H - T - B) * (b.value / max);
      chart.append(svg("rect", {class: "bar", x: L + i * step + 2, width: Math.max(1, step - 4),
                                y: H - B - h, height: h, "data-label": b.label,
                                "data-value": String(b.value)},
                       svg("title", {}, `batch size ${b.label}: ${b.value}`)),
                   svg("text", {x: L + (i + 0.5) * step, y: H - 6, "text-anchor": "middle"},
                       b.label));
    });
    return el("figure", {}, el("figcaption", {}, title), chart);
  }

  // ------------------------------------------------------------------------ derivations
  function rowsOf(snap) {  // every (model, priority) the config has, and any extra seen
    const rows = [];
    for (const model of Object.keys(snap.models)) {
      for (const priority of snap.levels) rows.push({model, priority});
    }
    for (const [n, labels] of snap.samples) {
      if (n === "tidegate_requests_total" && !snap.models[labels.model] &&
          !rows.some((r) => r.model === labels.model && r.priority === labels.priority)) {
        rows.push({model: labels.model, priority: labels.priority});
      }
    }
    return rows;
  }
  // A quantile of a series the row does not have (TTFT of embeddings: no stream) is n/a;
  // of one without a request in the window, NaN.
  function traffic(base, cur, row) {
    const dt = cur.at - base.at;
    const s0 = base.samples, s1 = cur.samples;
    const done = increase(total(s0, "tidegate_requests_total", row),
                          total(s1, "tidegate_requests_total", row));
    const out = {
      qps: done === null ? 0 : done / dt,
      depth: total(s1, "tidegate_queue_depth", row),
    };
    for (const phase of ["ttft", "e2e", "queue"]) {
      const match = {...row, phase};
      const after = buckets(s1, "tidegate_request_duration_seconds", match);
      const inc = bucketIncrease(buckets(s0, "tidegate_request_duration_seconds", match), after);
      for (const q of QUANTILES) {
        out[`${phase}_p${Math.round(q * 100)}`] = after.size ? quantile(q, inc) : null;
      }
    }
    return out;
  }
  function outcomes(base, cur, row) {  // per outcome label: rate and total
    const dt = cur.at - base.at, out = {};
    for (const [n, labels, value] of cur.samples) {
      if (n !== "tidegate_requests_total" || !matches(labels, row)) continue;
      const before = total(base.samples, n, labels);
      out[labels.outcome] = {rate: increase(before, value) / dt, total: value};
    }
    return out;
  }
  function replicaOf(snap, id) { return snap.replicas.find((r) => r.id === id) || null; }
  function resources(base, cur, replica) {
    const before = replicaOf(base, replica.id);
    const p1 = replica.process, p0 = before && before.process;
    let cpu = null;
    if (p1 && p1.cpu_seconds !== null && p0 && p0.cpu_seconds !== null && cur.at > base.at) {
      cpu = 100 * increase(p0.cpu_seconds, p1.cpu_seconds) / (cur.at - base.at);
    }
    const s = replica.samples;
    return {
      cpu, rss: p1 ? p1.rss_bytes : null, source: p1 ? p1.source : null,
      gpuUtil: s ? total(s, "DCGM_FI_DEV_GPU_UTIL", {}) : null,
      fbUsed: s ? total(s, "DCGM_FI_DEV_FB_USED", {}) : null,
      fbFree: s ? total(s, "DCGM_FI_DEV_FB_FREE", {}) : null,
      weights: s ? total(s, "tidegate_engine_memory_bytes", {kind: "weights"}) : null,
    };
  }

  // ---------------------------------------------------------------------------- render
  function render() {
    const cur = snaps[snaps.length - 1], base = snaps[0];
    document.body.dataset.toAt = String(cur.at);
    document.body.dataset.fromAt = String(base.at);
    document.body.dataset.polls = String(polls);
    const ready = snaps.length > 1;
    document.getElementById("status").textContent = ready
      ? `updated ${clock(cur.at)} · every ${cur.poll_interval_s} s · rates and quantiles ` +
        `over the last ${(cur.at - base.at).toFixed(1)} s`
      : `updated ${clock(cur.at)} · rates from the next poll`;
    const point = {at: cur.at, values: {}};
    if (ready) renderTraffic(base, cur, point);
    renderReplicas(cur, point);
    renderBatches(base, cur);
    renderStartup(cur);
    if (ready) renderResources(base, cur, point);
    renderDoctor(cur.doctor);
    history.push(point);
    while (history.length && history[0].at < cur.at - cur.history_s) history.shift();
    drawCharts(cur);
  }

  function renderTraffic(base, cur, point) {
    const rows = [], outcomeRows = [];
    for (const row of rowsOf(cur)) {
      const t = traffic(base, cur, row), name = `${row.model}/${row.priority}`;
      const attrs = {"data-model": row.model, "data-priority": row.priority};
      if (cur.models[row.model]) {
        rows.push(el("tr", attrs, text(row.model), text(row.priority),
          num("qps", t.qps), num("queue_depth", t.depth),
          ...["ttft", "e2e"].flatMap((ph) => QUANTILES.map((q) => {
            const key = `${ph}_p${Math.round(q * 100)}`;
            return num(key, t[key]);
          }))));
        point.values[`qps:${name}`] = t.qps;
        point.values[`depth:${name}`] = t.depth;
        point.values[`ttft:${name}`] = t.ttft_p99;
        point.values[`e2e:${name}`] = t.e2e_p99;
      }
      const byOutcome = outcomes(base, cur, row), byStatus = {};
      for (const [outcome, v] of Object.entries(byOutcome)) {
        const status = STATUS_OF[outcome] || "other";
        const acc = byStatus[status] || (byStatus[status] = {rate: 0, total: 0});
        acc.rate += v.rate;
        acc.total += v.total;
      }
      if (!cur.models[row.model] && !Object.keys(byOutcome).length) continue;
      const labels = Object.entries(byOutcome).sort()
        .map(([o, v]) => `${o} ${fmt(v.rate)}/s (${fmt(v.total)})`).join(" · ");
      outcomeRows.push(el("tr", attrs, text(row.model), text(row.priority),
        ...STATUSES.flatMap((st) => {
          const v = byStatus[st] || {rate: 0, total: 0};
          return [num(`rate:${st}`, v.rate), num(`total:${st}`, v.total)];
        }),
        text(labels || "–")));
    }
    const quantileHeads = ["ttft", "e2e"].flatMap((ph) =>
      QUANTILES.map((q) => `${ph.toUpperCase()} P${Math.round(q * 100)} (s)`));
    table("traffic-table", ["model", "priority", "requests/s", "queued", ...quantileHeads], rows);
    table("outcome-table", ["model", "priority",
      ...STATUSES.flatMap((st) => [`${st} /s`, `${st} total`]), "by outcome"], outcomeRows);
  }

  function renderReplicas(cur, point) {
    // A state no replica is in any more leaves /metrics; its line goes to 0.
    for (const key of replicaSeries) point.values[key] = 0;
    for (const [n, labels, value] of cur.samples) {
      if (n === "tidegate_replicas") {
        const key = `replicas:${labels.model}/${labels.pool}/${labels.state}`;
        point.values[key] = value;
        replicaSeries.add(key);
      }
    }
    const desired = {};
    for (const [n, labels, value] of cur.samples) {
      if (n === "tidegate_desired_replicas") desired[labels.model] = value;
    }
    table("replica-table", ["replica", "model", "pool", "kind", "state", "in flight", "slots",
                            "restarts", "desired (model)", "detail"],
      cur.replicas.map((r) => el("tr", {"data-replica": r.id},
        text(r.id), text(r.model), text(r.pool), text(r.kind),
        text(r.state, `state-${r.state}`), num("in_flight", r.in_flight),
        num("slots", r.slots), num("restarts", r.restarts),
        num("desired", r.model in desired ? desired[r.model] : null),
        text(r.metrics_error || ""))));
  }

  function renderBatches(base, cur) {
    const figures = [];
    for (const model of Object.keys(cur.models)) {
      let before = new Map(), after = new Map();
      for (const replica of cur.replicas) {
        if (replica.model !== model || !replica.samples) continue;
        const old = replicaOf(base, replica.id);
        add(after, buckets(replica.samples, "tidegate_batch_size", {}));
        if (old && old.samples) add(before, buckets(old.samples, "tidegate_batch_size", {}));
      }
      if (!after.size) {
        figures.push(el("figure", {}, el("figcaption", {}, `${model}: n/a (no batch metrics)`)));
        continue;
      }
      let cumulative = bucketIncrease(before, after), span = "in the window";
      if (!(cumulative[cumulative.length - 1][1] > 0)) {
        cumulative = bucketIncrease(new Map(), after);
        span = "since start (none in the window)";
      }
      const bars = cumulative.map(([le, count], i) => {
        const prevLe = i ? cumulative[i - 1][0] : 0, prev = i ? cumulative[i - 1][1] : 0;
        const label = le === Infinity ? `>${prevLe}` : (le - prevLe <= 1 ? `${le}` :
                                                        `${prevLe + 1}-${le}`);
        return {label, value: count - prev};
      });
      // Sizes past the largest batch seen are left off (one empty bar stays).
      const last = bars.reduce((at, b, i) => (b.value > 0 ? i : at), 0);
      const figure = barChart(`${model}: batches by size, ${span}`, bars.slice(0, last + 2),
                              widthOf(document.getElementById("batch-charts"), 480));
      figure.dataset.model = model;
      figures.push(figure);
    }
    document.getElementById("batch-charts").replaceChildren(...figures);
  }
  function add(into, from) { for (const [le, v] of from) into.set(le, (into.get(le) || 0) + v); }

  function renderStartup(cur) {
    const rows = Object.keys(cur.models).map((model) => {
      const match = {model};
      const count = total(cur.samples, "tidegate_cold_start_seconds_count", match);
      const sum = total(cur.samples, "tidegate_cold_start_seconds_sum", match);
      const restarts = cur.replicas.filter((r) => r.model === model)
        .reduce((acc, r) => acc + (r.restarts || 0), 0);
      return el("tr", {"data-model": model}, text(model), num("cold_starts", count),
                num("cold_start_mean_s", count ? sum / count : null), num("restarts", restarts));
    });
    table("coldstart-table", ["model", "cold starts", "mean cold start (s)",
                              "worker restarts"], rows);
    table("startup-table", ["replica", "model", "launch to ready (s)", "model load (s)",
                            "warm-up (s)", "process start to ready (s)"],
      cur.replicas.map((r) => {
        const phase = (p) => r.samples
          ? total(r.samples, "tidegate_worker_startup_seconds", {phase: p}) : null;
        return el("tr", {"data-replica": r.id}, text(r.id), text(r.model),
                  num("startup_s", r.startup_s), num("load_s", phase("load")),
                  num("warmup_s", phase("warmup")), num("ready_s", phase("ready")));
      }));
  }

  function renderResources(base, cur, point) {
    const mib = (bytes) => (bytes === null || bytes === undefined ? null : bytes / 2 ** 20);
    table("resource-table", ["replica", "model", "CPU %", "RSS (MiB)", "GPU util %",
                             "GPU mem used (MiB)", "GPU mem free (MiB)", "weights (MiB)",
                             "source"],
      cur.replicas.map((r) => {
        const u = resources(base, cur, r);
        if (u.cpu !== null) point.values[`cpu:${r.id}`] = u.cpu;
        if (u.rss !== null) point.values[`rss:${r.id}`] = mib(u.rss);
        return el("tr", {"data-replica": r.id}, text(r.id), text(r.model),
                  num("cpu_pct", u.cpu), num("rss_mib", mib(u.rss)),
                  num("gpu_util_pct", u.gpuUtil), num("gpu_fb_used_mib", u.fbUsed),
                  num("gpu_fb_free_mib", u.fbFree), num("weights_mib", mib(u.weights)),
                  text(u.source || r.metrics_error || "n/a"));
      }));
  }

  function renderDoctor(doctor) {
    const node = document.getElementById("doctor-findings");
    if (!doctor || !doctor.available) {
      node.className = "muted";
      node.textContent = (doctor && doctor.reason) || "doctor not available";
      return;
    }
    const findings = doctor.findings || [];
    node.className = "";
    if (!findings.length) {
      node.replaceChildren(el("p", {class: "muted"},
        `no findings over the last ${fmt(doctor.window_s)} s`));
      return;
    }
    node.replaceChildren(...findings.map((f) => el("div",
      {class: "finding", "data-severity": f.severity, "data-rule": f.rule},
      el("div", {}, el("span", {class: "severity"}, f.severity), el("strong", {}, f.rule),
         f.model ? ` (${f.model})` : "", " — ", f.symptom || ""),
      f.numbers ? el("div", {class: "muted"}, numbersText(f.numbers)) : "",
      f.cause ? el("div", {}, "cause: ", f.cause) : "",
      f.fix ? el("div", {}, "fix: ", f.fix) : "",
      f.config_diff ? el("pre", {}, f.config_diff) : "")));
  }
  function numbersText(numbers) {
    if (typeof numbers !== "object") return String(numbers);
    return Object.entries(numbers)
      .map(([k, v]) => `${k} ${typeof v === "number" ? fmt(v) : JSON.stringify(v)}`).join(" · ");
  }

  function drawCharts(cur) {
    // From the first poll, or from an earlier scale event still in the history: a page
    // opened just after a scale-up shows it.
    const to = cur.at, oldest = to - cur.history_s;
    const events = cur.scale_events.filter((e) => e.at >= oldest && e.at <= to);
    const from = Math.max(Math.min(history[0].at, ...events.map((e) => e.at)), oldest);
    const byPrefix = (prefix) => {
      const names = new Set();
      for (const p of history) for (const k in p.values) if (k.startsWith(prefix)) names.add(k);
      return [...names].sort().map((k) => ({
        name: k.slice(prefix.length),
        points: history.filter((p) => k in p.values).map((p) => [p.at, p.values[k]]),
      }));
    };
    lineChart("chart-qps", byPrefix("qps:"), from, to);
    lineChart("chart-depth", byPrefix("depth:"), from, to);
    lineChart("chart-ttft", byPrefix("ttft:"), from, to);
    lineChart("chart-e2e", byPrefix("e2e:"), from, to);
    const markers = events.map((e) => ({
      at: e.at, direction: e.direction,
      label: `${e.direction === "up" ? "▲" : "▼"} ${e.model} ${e.from}→${e.to}`,
      title: `${clock(e.at)} ${e.model}: ${e.from} → ${e.to} replicas (${e.reason})`,
    }));
    lineChart("chart-replicas", byPrefix("replicas:"), from, to, markers);
    lineChart("chart-cpu", byPrefix("cpu:"), from, to);
    lineChart("chart-rss", byPrefix("rss:"), from, to);
  }

  // ----------------------------------------------------------------------------- polling
  async function poll() {
    let delay_s = 2;
    try {
      const answer = await fetch("dashboard/data", {cache: "no-store", credentials: "same-origin"});
      if (!answer.ok) throw new Error(`dashboard/data answered ${answer.status}`);
      const snap = await answer.json();
      delay_s = snap.poll_interval_s;
      polls += 1;
      snaps.push(snap);
      // Keep the oldest snapshot still inside the window (and always the previous one).
      while (snaps.length > 2 && snaps[1].at <= snap.at - snap.window_s) snaps.shift();
      render();
    } catch (error) {
      document.getElementById("status").textContent = `poll failed: ${error.message}`;
    }
    setTimeout(poll, delay_s * 1000);
  }
  window.tidegateDashboard = {quantile};  // for tests that check it against Prometheus'
  poll();
})();
