// Interactive figures: a page's widget records carry their data as JSON; this file draws them.
// Everything is local and runs from file://. Without JavaScript the widget stays hidden and the
// page's static figures tell the same story.
//
// window.course.simulate(name, p, m, chunks, cost) runs lecture 05's pipeline simulator
// (lectures/pipeline/simulate.py: simulate) on the action lists the Python make_schedule produced for
// this page, and returns the same makespan and bubble.
(function () {
  "use strict";
  var course = (window.course = window.course || {});
  var schedules = {};          // "name|p|m|chunks" -> {name, p, m, chunks, style, ranks, formula, why}

  // --- the simulator, a line-by-line port of lectures/pipeline/simulate.py -----------------------
  function parseAction(text) {
    var m = /^([FBW])(\d+)(?:\.(\d+))?$/.exec(text);
    if (!m) throw new Error("not an action: " + text);
    return { kind: m[1], microbatch: +m[2], chunk: m[3] ? +m[3] : 0, text: text };
  }
  function makeLayout(ranks, chunks, style) {
    return {
      ranks: ranks, chunks: chunks, stages: ranks * chunks,
      stage: function (rank, chunk) {
        if (style === "v") return chunk === 0 ? rank : 2 * ranks - 1 - rank;
        return chunk * ranks + rank;
      },
      rankOf: function (stage) {
        if (style === "v") return stage < ranks ? stage : 2 * ranks - 1 - stage;
        return stage % ranks;
      }
    };
  }
  function dependencies(a, stage, layout) {
    var i = a.microbatch;
    if (a.kind === "F") return stage > 0 ? [["F", stage - 1, i]] : [];
    if (a.kind === "B") {
      var d = [["F", stage, i]];
      if (stage < layout.stages - 1) d.push(["B", stage + 1, i]);
      return d;
    }
    return [["B", stage, i]];
  }
  // finish times by (kind, stage, micro-batch), in a flat array: a key per lookup would cost a
  // string join each, and the largest schedules look up thousands
  var KINDS = { F: 0, B: 1, W: 2 };
  function finishTimes(lists, layout) {
    var m = 0;
    lists.forEach(function (acts) { acts.forEach(function (a) { m = Math.max(m, a.microbatch + 1); }); });
    var times = new Float64Array(3 * layout.stages * m).fill(NaN);
    times.slot = function (kind, stage, i) { return (KINDS[kind] * layout.stages + stage) * m + i; };
    return times;
  }
  function simulateLists(lists, layout, cost) {
    var split = lists.some(function (acts) { return acts.some(function (a) { return a.kind === "W"; }); });
    var W = cost.W || 0, send = cost.send || 0;
    var dur = { F: cost.F, B: cost.B + (split ? 0 : W), W: W };
    var n = layout.ranks, pos = [], clock = [], timeline = [], finish = finishTimes(lists, layout);
    for (var r = 0; r < n; r++) { pos.push(0); clock.push(0.0); timeline.push([]); }
    var progress = true;
    while (progress) {
      progress = false;
      for (r = 0; r < n; r++) {
        var acts = lists[r];
        while (pos[r] < acts.length) {
          var a = acts[pos[r]], s = layout.stage(r, a.chunk), deps = dependencies(a, s, layout);
          var ready = [clock[r]], missing = false;
          for (var k = 0; k < deps.length; k++) {
            var done = finish[finish.slot(deps[k][0], deps[k][1], deps[k][2])];
            if (isNaN(done)) { missing = true; break; }
            ready.push(done + (layout.rankOf(deps[k][1]) !== r ? send : 0));
          }
          if (missing) break;
          var start = Math.max.apply(null, ready);
          clock[r] = start + dur[a.kind];
          finish[finish.slot(a.kind, s, a.microbatch)] = clock[r];
          timeline[r].push([a, start, clock[r]]);
          pos[r] += 1;
          progress = true;
        }
      }
    }
    for (r = 0; r < n; r++) if (pos[r] < lists[r].length) throw new Error("deadlock at rank " + r);
    var makespan = Math.max.apply(null, clock);
    var busy = timeline.map(function (row) {
      var b = 0;
      row.forEach(function (e) { b += e[2] - e[1]; });
      return b;
    });
    var total = 0;
    busy.forEach(function (b) { total += b; });
    return { timeline: timeline, makespan: makespan, busy: busy,
             bubble: makespan ? 1 - total / (n * makespan) : 0.0 };
  }
  function entry(name, p, m, chunks) {
    var e = schedules[[name, p, m, chunks].join("|")];
    if (!e) throw new Error("no embedded schedule " + [name, p, m, chunks].join(", "));
    if (!e.lists) e.lists = e.ranks.map(function (row) { return row ? row.split(" ").map(parseAction) : []; });
    return e;
  }
  course.simulate = function (name, p, m, chunks, cost) {
    var e = entry(name, p, m, chunks);
    var sim = simulateLists(e.lists, makeLayout(e.p, e.chunks, e.style), cost);
    return { makespan: sim.makespan, bubble: sim.bubble };
  };
  course.scheduleKeys = function () { return Object.keys(schedules); };
  // the paper's bubble at these per-stage costs, or null where its assumptions fail: a port of
  // lectures/pipeline/explorer.py: formula_bubble
  function formulaBubble(f, p, m, c) {
    if (!f || (c.send || 0) !== 0) return null;
    if (f.fraction !== undefined) return f.fraction;
    var W = c.W || 0;
    if (W > c.F || W > c.B) return null;
    var idle = (p - 1) * (f.idle[0] * c.F + f.idle[1] * c.B + f.idle[2] * W), work = m * (c.F + c.B + W);
    return work + idle > 0 ? idle / (work + idle) : 0.0;
  }
  course.formulaBubble = function (name, p, m, chunks, cost) {
    return formulaBubble(entry(name, p, m, chunks).formula, p, m, cost);
  };

  // --- drawing helpers ----------------------------------------------------------------------
  var SVGNS = "http://www.w3.org/2000/svg";
  function el(tag, attrs, parent, ns) {
    var e = ns ? document.createElementNS(SVGNS, tag) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(e);
    return e;
  }
  // A large figure is written as one string of markup: thousands of createElementNS and
  // setAttribute calls cost more than a frame (16 ms), one parse of the string does not.
  function esc(text) {
    return String(text).replace(/[&<>"]/g, function (c) { return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]; });
  }
  function tag(name, attrs, inner) {
    var out = "<" + name;
    Object.keys(attrs).forEach(function (k) { out += " " + k + '="' + esc(attrs[k]) + '"'; });
    return out + ">" + (inner || "") + "</" + name + ">";
  }
  function tenth(x) { return Math.round(x * 10) / 10; }   // a tenth of a pixel: short markup, no visible change
  var COLOURS = { F: "#4c78a8", B: "#f58518", W: "#54a24b" };   // as lecture 05's static figures: F blue, B orange, W green
  function pct(x) { return (100 * x).toFixed(1) + "%"; }

  // In flight: micro-batches whose forward ran on this rank and whose activations are not yet
  // released (by B, or by W when the schedule splits the backward), counted per chunk.
  function inFlight(row, split) {
    var events = [];
    row.forEach(function (e) {
      if (e[0].kind === "F") events.push([e[2], +1]);
      if (e[0].kind === (split ? "W" : "B")) events.push([e[2], -1]);
    });
    events.sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; });
    var now = 0, peak = 0, steps = [[0, 0]];
    events.forEach(function (ev) { now += ev[1]; peak = Math.max(peak, now); steps.push([ev[0], now]); });
    return { steps: steps, peak: peak };
  }

  function drawExplorer(root, data) {
    data.schedules.forEach(function (e) { schedules[[e.name, e.p, e.m, e.chunks].join("|")] = e; });
    var body = root.querySelector(".widget-body");
    body.hidden = false;
    root.classList.add("live");
    var form = el("div", { "class": "widget-controls" }, body);
    function select(label, options) {
      var wrap = el("label", {}, form);
      wrap.appendChild(document.createTextNode(label + " "));
      var s = el("select", {}, wrap);
      options.forEach(function (o) { el("option", { value: o }, s).textContent = o; });
      return s;
    }
    function number(label, value) {
      var wrap = el("label", {}, form);
      wrap.appendChild(document.createTextNode(label + " "));
      return el("input", { type: "number", min: "0", step: "0.1", value: value, inputmode: "decimal" }, wrap);
    }
    var names = [], seen = {};
    data.schedules.forEach(function (e) { if (!seen[e.name]) { seen[e.name] = 1; names.push(e.name); } });
    var sName = select("schedule", names), sP = select("p", []), sM = select("m", []), sV = select("chunks", []);
    var cF = number("F per stage", data.cost.F), cB = number("B", data.cost.B), cW = number("W", data.cost.W),
        cS = number("send", data.cost.send);
    var out = el("p", { "class": "widget-readout", "aria-live": "polite" }, body);
    var legend = el("p", { "class": "widget-legend quiet" }, body);
    // colours come from the stylesheet (the page's security policy allows no inline styles)
    [["F", "F forward"], ["B", "B backward (the input gradient when split)"], ["W", "W weight gradient"]].forEach(function (k) {
      el("span", { "class": "swatch swatch-" + k[0] }, legend).textContent = "■";
      legend.appendChild(document.createTextNode(" " + k[1] + " · "));
    });
    legend.appendChild(document.createTextNode("lighter: a rank's second chunk"));
    var svgBox = el("div", { "class": "widget-svg" }, body);
    var memBox = el("div", { "class": "widget-svg" }, body);

    function options(sel, values) {
      var old = sel.value;
      sel.innerHTML = "";
      values.forEach(function (v) { el("option", { value: v }, sel).textContent = v; });
      if (values.map(String).indexOf(old) >= 0) sel.value = old;
    }
    function refreshChoices() {
      var match = function (e, f) {
        return e.name === sName.value && (!f.p || e.p === +sP.value) && (!f.m || e.m === +sM.value);
      };
      var uniq = function (xs) { return xs.filter(function (x, i) { return xs.indexOf(x) === i; }).sort(function (a, b) { return a - b; }); };
      options(sP, uniq(data.schedules.filter(function (e) { return match(e, {}); }).map(function (e) { return e.p; })));
      options(sM, uniq(data.schedules.filter(function (e) { return match(e, { p: 1 }); }).map(function (e) { return e.m; })));
      options(sV, uniq(data.schedules.filter(function (e) { return match(e, { p: 1, m: 1 }); }).map(function (e) { return e.chunks; })));
    }
    // the inputs are per stage, as in the page's tables: a rank holding v chunks of its layers
    // runs each chunk's action in 1/v of the time (the send does not shrink)
    function cost(v) {
      return { F: +cF.value / v, B: +cB.value / v, W: +cW.value / v, send: +cS.value };
    }
    // what the costs cannot mean, in words: F and B take time (> 0), W and send may be free (>= 0);
    // an empty or unreadable field is not 0. With these, the bubble stays within 0-100%.
    var MAX_COST = 1e6;
    function costProblems() {
      var out = [];
      [[cF, "F", true], [cB, "B", true], [cW, "W", false], [cS, "send", false]].forEach(function (k) {
        var text = k[0].value.trim(), x = Number(text), bad = true;
        if (text === "" || !isFinite(x)) out.push(k[1] + " must be a number (the field is empty or unreadable)");
        else if (k[2] && x <= 0) out.push(k[1] + " must be positive, not " + text);
        else if (x < 0) out.push(k[1] + " must be 0 or more, not " + text);
        else if (x > MAX_COST) out.push(k[1] + " must be at most " + MAX_COST.toLocaleString("en") + ", not " + text);
        else bad = false;
        k[0].setAttribute("aria-invalid", bad ? "true" : "false");
      });
      return out;
    }
    function redraw() {
      var t0 = performance.now();
      var problems = costProblems();
      if (problems.length) {
        svgBox.innerHTML = "";
        memBox.innerHTML = "";
        out.textContent = "Not a valid cost: " + problems.join("; ") + ".";
        return;
      }
      var e = entry(sName.value, +sP.value, +sM.value, +sV.value);
      var c = cost(e.chunks), sim = simulateLists(e.lists, makeLayout(e.p, e.chunks, e.style), c);
      var split = e.lists.some(function (acts) { return acts.some(function (a) { return a.kind === "W"; }); });
      // the timeline: one lane per rank, every action a box, one shared time axis, drawn at the
      // box's own width so that text stays legible on a phone. The boxes of one colour are one
      // path: the largest schedules have over 700, and as elements parsing and laying them out
      // costs more than a frame; hovering names the box under the pointer instead of a title each.
      boxWidth = boxWidth || svgBox.clientWidth;
      var W = Math.max(300, Math.min(960, boxWidth || 720)), lane = 22, top = 18, left = 46,
          H = top + lane * e.p + 24;
      var scale = (W - left - 8) / (sim.makespan || 1), parts = [], boxes = {}, count = 0;
      sim.timeline.forEach(function (row, r) {
        parts.push(tag("text", { x: 4, y: top + lane * r + 15, "font-size": 11 }, "rank " + r));
        row.forEach(function (ev) {
          var x = left + ev[1] * scale, w = Math.max(0.5, (ev[2] - ev[1]) * scale), look = ev[0].kind + (ev[0].chunk ? 1 : 0);
          (boxes[look] = boxes[look] || []).push("M" + tenth(x) + " " + (top + lane * r + 2) + "h" + tenth(w) +
                                                 "v" + (lane - 4) + "h" + tenth(-w) + "z");
          count += 1;
          // a label only where it fits inside its box (about 5.5 px a character at 9 px): the
          // whole name, else the micro-batch number alone (the colour says F, B or W), else none
          var label = null;
          if (w >= 8.5) {       // room for one character: most boxes of the largest schedules have none
            label = ev[0].text;
            if (label.length * 5.5 + 3 > w) label = label.replace(/^[A-Za-z]+/, "");
            if (label.length * 5.5 + 3 > w) label = null;
          }
          if (label) parts.push(tag("text", { x: x + w / 2, y: top + lane * r + 15, "font-size": 9, fill: "#fff",
                                              "text-anchor": "middle" }, esc(label)));
        });
      });
      Object.keys(boxes).forEach(function (look) {
        parts.unshift(tag("path", { d: boxes[look].join(""), fill: COLOURS[look[0]], opacity: look[1] === "1" ? 0.65 : 1 }));
      });
      parts.push(tag("text", { x: left, y: H - 6, "font-size": 10 }, "0"));
      parts.push(tag("text", { x: W - 8, y: H - 6, "font-size": 10, "text-anchor": "end" },
                     "time " + sim.makespan.toFixed(2)));
      svgBox.innerHTML = tag("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "data-boxes": count,
                                      "aria-label": e.name + " timeline, " + e.p + " ranks" },
                             tag("title", {}, "") + parts.join(""));
      drawn = { timeline: sim.timeline, W: W, left: left, top: top, lane: lane, scale: scale };
      // micro-batches each rank holds over time
      var mh = 22 * e.p + 30, lines = [];
      // held in micro-batches: a (micro-batch, chunk) counts 1/v, as on the page
      var peaks = [], maxPeak = 1e-9;
      sim.timeline.forEach(function (row) {
        var f = inFlight(row, split);
        f.steps = f.steps.map(function (st) { return [st[0], st[1] / e.chunks]; });
        f.peak = f.peak / e.chunks;
        peaks.push(f);
        maxPeak = Math.max(maxPeak, f.peak);
      });
      peaks.forEach(function (f, r) {
        var y0 = 14 + 22 * (r + 1), pts = [], y = y0;
        f.steps.forEach(function (s, i) {
          var x = tenth(left + s[0] * scale);
          if (i) pts.push(x + "," + y);          // level until this step, then up or down
          y = tenth(y0 - 18 * s[1] / maxPeak);
          pts.push(x + "," + y);
        });
        pts.push(tenth(left + sim.makespan * scale) + "," + y);
        lines.push(tag("polyline", { points: pts.join(" "), fill: "none", stroke: "#555" }));
        lines.push(tag("text", { x: 4, y: y0, "font-size": 10 }, "r" + r + " ≤" + (+f.peak.toFixed(2))));
      });
      lines.push(tag("text", { x: left, y: 11, "font-size": 10 }, esc("activations held, in micro-batches" +
        (e.chunks > 1 ? " (a chunk counts 1/" + e.chunks + ")" : "") + " (peak ≤)")));
      memBox.innerHTML = tag("svg", { viewBox: "0 0 " + W + " " + mh, role: "img",
                                      "aria-label": "micro-batches held per rank" }, lines.join(""));
      var f = e.formula, value = formulaBubble(f, e.p, e.m, cost(1));
      var theory = !f ? "no closed form here (" + e.why + ")" :
        value === null ? "no closed form here (" + f.text + ", " + f.source + ", assumes " + f.assumes + ")" :
        "formula " + f.text + " (" + f.source + ") = " + pct(value);
      out.textContent = e.name + ", p = " + e.p + ", m = " + e.m + ", chunks = " + e.chunks +
        ": makespan " + sim.makespan.toFixed(2) + ", bubble " + pct(sim.bubble) +
        " measured on this timeline; " + theory + "; most held on a rank: " + (+maxPeak.toFixed(2)) + " micro-batches.";
      var ms = performance.now() - t0;
      root.setAttribute("data-redraw-ms", ms.toFixed(3));
    }
    var drawn = null;   // where the last redraw put the boxes, for the tooltip
    // the box's width, read again only after the window changed: reading it right after a redraw
    // would make the browser lay out the previous timeline first, inside this redraw
    var boxWidth = 0;
    window.addEventListener("resize", function () { boxWidth = 0; });
    svgBox.addEventListener("mousemove", function (event) {
      var svg = svgBox.querySelector("svg"), box = svg && svg.getBoundingClientRect();
      if (!drawn || !box || !box.width) return;
      var k = drawn.W / box.width, x = (event.clientX - box.left) * k, y = (event.clientY - box.top) * k;
      var row = drawn.timeline[Math.floor((y - drawn.top) / drawn.lane)] || [], t = (x - drawn.left) / drawn.scale, said = "";
      for (var i = 0; i < row.length; i++) {
        if (row[i][1] <= t && t <= row[i][2]) said = row[i][0].text + ": " + row[i][1].toFixed(2) + "–" + row[i][2].toFixed(2);
      }
      svg.querySelector("title").textContent = said;
    });
    sName.addEventListener("change", function () { refreshChoices(); redraw(); });
    sP.addEventListener("change", function () { refreshChoices(); redraw(); });
    sM.addEventListener("change", function () { refreshChoices(); redraw(); });
    [sV, cF, cB, cW, cS].forEach(function (x) { x.addEventListener("input", redraw); x.addEventListener("change", redraw); });
    sName.value = data.initial.name;
    refreshChoices();
    sP.value = data.initial.p; refreshChoices();
    sM.value = data.initial.m; refreshChoices();
    sV.value = data.initial.chunks;
    redraw();
  }

  // --- the memory estimator, a port of lectures/layout/estimator.py --------------------------------
  // Argument and field names follow ModelShape and Layout; numbers equal estimate_memory's.
  var PRECISION_BYTES = null;   // from the widget's data: the Python table itself
  function floorDiv(a, b) { return Math.floor(a / b); }
  function shapeDefaults(m) {
    var d = { mlp_matrices: 2, kv_expanded: false, bias: true, norm_params: 2, learned_positions: true, tied: false,
              experts: 0, top_k: 1, shared_experts: 0, expert_ffn: 0, dense_layers: 0, route_nodes: 0 };
    var out = {};
    Object.keys(d).forEach(function (k) { out[k] = d[k]; });
    Object.keys(m).forEach(function (k) { out[k] = m[k]; });
    return out;
  }
  function layoutDefaults(l) {
    var d = { dp: 1, pp: 1, cp: 1, tp: 1, zero: 0, micro_batch: 1, micro_batches: 1, recompute: "none",
              precision: "fp32", sp: false, schedule: "1f1b", vocab_parallel: true, virtual_stages: 1, ep: 1,
              cp_algorithm: "ring" };
    var out = {};
    Object.keys(d).forEach(function (k) { out[k] = d[k]; });
    Object.keys(l).forEach(function (k) { out[k] = l[k]; });
    return out;
  }
  function kvDim(m) { return m.kv_heads * floorDiv(m.hidden, m.heads); }
  function expertParams(m, tp) {   // ModelShape.expert_params
    var h = m.hidden, f = m.expert_ffn, b = m.bias ? 1 : 0;
    return [((m.mlp_matrices - 1) * h * f + f * h + b * (m.mlp_matrices - 1) * f) / tp, b * h];
  }
  function layerParams(m, tp, moe) {   // ModelShape.layer_params
    var h = m.hidden, kv = kvDim(m), b = m.bias ? 1 : 0;
    var sharded = (h * h + 2 * h * kv) + (h * h) + b * (h + 2 * kv);
    var replicated = b * h + 2 * m.norm_params * h;
    if (moe) {
      var e = expertParams(m, 1);
      sharded += m.shared_experts * e[0];
      replicated += m.shared_experts * e[1] + h * m.experts;
    } else {
      var f = m.ffn;
      sharded += (m.mlp_matrices - 1) * h * f + f * h + b * (m.mlp_matrices - 1) * f;
      replicated += b * h;
    }
    return [sharded / tp, replicated];
  }
  function sum2(x) { return x[0] + x[1]; }
  function moeLayers(m) { return m.experts ? m.layers - m.dense_layers : 0; }
  function matrixPerToken(m, moe) {   // ModelShape.matrix_params_per_token
    if (!moe) return layerParams(m, 1)[0];
    return layerParams(m, 1, true)[0] + m.hidden * m.experts + m.top_k * expertParams(m, 1)[0];
  }
  function rankBlocks(m, pp, v) {   // estimator.rank_blocks: [dense, moe] per pipeline rank
    var stages = stageLayers(m.layers, pp * v), starts = [0], out = [];
    for (var k = 1; k < pp * v; k++) starts.push(starts[k - 1] + stages[k - 1]);
    for (var r = 0; r < pp; r++) {
      var n = 0, moe = 0;
      for (var c = 0; c < v; c++) {
        var a = starts[c * pp + r], len = stages[c * pp + r];
        n += len;
        if (m.experts) moe += Math.max(0, a + len - Math.max(a, m.dense_layers));
      }
      out.push([n - moe, moe]);
    }
    return out;
  }
  function blockParams(m, l, stage) {   // estimator.block_params
    var b = rankBlocks(m, l.pp, l.virtual_stages)[stage];
    var shared = b[0] * sum2(layerParams(m, l.tp)) + b[1] * sum2(layerParams(m, l.tp, true));
    var experts = m.experts ? b[1] * m.experts / l.ep * sum2(expertParams(m, l.tp)) : 0;
    return [shared, experts];
  }
  function largestBlock(m, l) {
    var dense = (m.dense_layers || !m.experts) ? sum2(layerParams(m, l.tp)) : 0;
    var moe = m.experts ? sum2(layerParams(m, l.tp, true)) + m.experts / l.ep * sum2(expertParams(m, l.tp)) : 0;
    return Math.max(dense, moe);
  }
  function embeddingParams(m) { return m.vocab * m.hidden + (m.learned_positions ? 1 : 0) * m.seq * m.hidden; }
  function headParams(m) { return m.norm_params * m.hidden + (m.tied ? 0 : m.vocab * m.hidden); }
  function actElementsPerToken(m, tp, sp, selective, moe) {
    var h = m.hidden, f = m.ffn, a = m.heads;
    var kv = m.kv_expanded ? h : kvDim(m), per = m.mlp_matrices === 2 ? 2 : 4, mlp;
    if (moe) mlp = floorDiv(per * m.expert_ffn * (m.top_k + m.shared_experts), selective ? 2 : 1) + 2 * m.top_k * h + m.experts;
    else mlp = floorDiv(per * f, selective ? 2 : 1);
    var split = (2 * h + 2 * kv + a + mlp) / tp;
    var stream = (selective ? 2 : 4) * h + 4;
    return split + (sp ? stream / tp : stream);
  }
  function stageLayers(layers, pp) {
    var out = [];
    for (var k = 0; k < pp; k++) out.push(floorDiv((k + 1) * layers, pp) - floorDiv(k * layers, pp));
    return out;
  }
  function rankLayers(layers, pp, v) {   // chunk c of rank r is stage c·pp + r
    var stages = stageLayers(layers, pp * v), out = [];
    for (var r = 0; r < pp; r++) {
      var n = 0;
      for (var c = 0; c < v; c++) n += stages[c * pp + r];
      out.push(n);
    }
    return out;
  }
  function heldChunks(l, stage) {
    var p = l.pp, mb = l.micro_batches, v = l.virtual_stages;
    if (p === 1) return 1;
    if (l.schedule === "gpipe") return mb * v;
    if (v === 1) return Math.min(p - stage, mb);
    var firstGroup = Math.ceil(mb / Math.max(1, floorDiv(mb, p)));
    return Math.min(mb * v, 2 * (p - stage - 1) + (v - 1) * firstGroup + 1);
  }
  function inFlightMb(l, stage) { return heldChunks(l, stage) / l.virtual_stages; }
  function stageParams(m, l, stage) {
    var tp = l.tp, first = stage === 0, last = stage === l.pp - 1;
    var n = sum2(blockParams(m, l, stage));
    if (first) {
      n += embeddingParams(m);
      if (l.vocab_parallel) n -= m.vocab * m.hidden * (1 - 1 / tp);
    }
    if (last) {
      var head = headParams(m);
      if (l.vocab_parallel && !m.tied) head = m.norm_params * m.hidden + m.vocab * m.hidden / tp;
      n += head;
    }
    return n;
  }
  function activationBytes(m, l, stage) {
    var B = PRECISION_BYTES[l.precision].act;
    var tokens = l.micro_batch * m.seq / l.cp;
    var nLayers = rankLayers(m.layers, l.pp, l.virtual_stages)[stage];
    var kinds = rankBlocks(m, l.pp, l.virtual_stages)[stage];
    var elements = function (sel) {
      return kinds[0] * actElementsPerToken(m, l.tp, l.sp, sel, false) + kinds[1] * actElementsPerToken(m, l.tp, l.sp, sel, true);
    };
    var largest = function (sel) {   // one block of the largest kind on this rank
      var out = -Infinity;
      if (kinds[0]) out = Math.max(out, actElementsPerToken(m, l.tp, l.sp, sel, false));
      if (kinds[1]) out = Math.max(out, actElementsPerToken(m, l.tp, l.sp, sel, true));
      return nLayers ? out : 0;
    };
    var one = largest(false), oneKept = largest(true);
    var v = l.vocab_parallel ? m.vocab / l.tp : m.vocab;
    var lossGrads = stage === l.pp - 1 ? 2 * v * 4 * tokens : 0;
    var stored, transient;
    if (l.recompute === "full") {
      stored = nLayers * m.hidden * B * (l.sp ? 1 / l.tp : 1);
      transient = Math.max(one * B * tokens, lossGrads);
    } else if (l.recompute === "selective") {
      stored = elements(true) * B;
      transient = Math.max((one - oneKept) * B * tokens, lossGrads);
    } else {
      stored = elements(false) * B;
      transient = lossGrads;
    }
    if (stage === 0) stored += 8;
    if (stage === l.pp - 1) stored += (2 * m.hidden + 2) * B + v * 4 + 8;
    return [tokens * stored * inFlightMb(l, stage), transient];
  }
  function estimateStage(m, l, stage) {
    var B = PRECISION_BYTES[l.precision];
    var n = stageParams(m, l, stage);
    var dp = l.dp * l.cp, z = l.zero;
    var nLayers = rankLayers(m.layers, l.pp, l.virtual_stages)[stage];
    var bp = blockParams(m, l, stage), experts = bp[1];
    var gathered = (Math.min(2, nLayers) * largestBlock(m, l) + n - sum2(bp)) * (B.weights + B.grads);   // + embedding, head
    // ZeRO shards the routed experts over their dp·cp/ep replicas
    var shards = function (on) { return (n - experts) / (on ? dp : 1) + experts / (on ? floorDiv(dp, l.ep) : 1); };
    var act = activationBytes(m, l, stage);
    var out = { stage: stage, params: n,
                weights: B.weights * shards(z >= 3),
                grads: B.grads * shards(z >= 2),
                optimizer: B.optimizer * shards(z >= 1),
                gathered: z >= 3 && dp > 1 ? gathered : 0,
                activations: act[0] + act[1],
                "stored activations": act[0] };
    out.total = out.weights + out.grads + out.optimizer + out.gathered + out.activations;
    return out;
  }
  course.estimateMemory = function (model, layout, stage) {
    var m = shapeDefaults(model), l = layoutDefaults(layout);
    if (stage !== undefined && stage !== null) return estimateStage(m, l, stage);
    var best = null;     // the most loaded stage; the earliest on ties
    for (var s = 0; s < l.pp; s++) {
      var e = estimateStage(m, l, s);
      if (!best || e.total > best.total) best = e;
    }
    return best;
  };

  // --- the step-time model, a port of lectures/layout/step_time.py --------------------------------
  var MESH_AXES = ["dp", "pp", "cp", "tp"];
  function tensorsPerLayer(m) {
    return (4 + m.mlp_matrices) * (1 + (m.bias ? 1 : 0)) + 2 * (m.norm_params > 0 ? 1 : 0) * m.norm_params;
  }
  function axisLink(hw, l, axis) {   // inside a node only when the group's span tiles the nodes
    var sizes = { dp: l.dp, pp: l.pp, cp: l.cp, tp: l.tp }, k = MESH_AXES.indexOf(axis === "ep" ? "dp" : axis), stride = 1;
    for (var i = k + 1; i < MESH_AXES.length; i++) stride *= sizes[MESH_AXES[i]];
    var size = axis === "ep" ? l.ep : sizes[axis];
    return hw.ranks_per_node % (stride * size) === 0 ? hw.intra : hw.inter;
  }
  function p2pLink(hw, l, axis) { return hw.p2p || axisLink(hw, l, axis); }
  function allReduceTime(n, nbytes, link) {
    return n === 1 ? 0.0 : 2 * (n - 1) * link[0] + 2 * (n - 1) / n * nbytes / link[1];
  }
  function gatherTime(n, nbytes, link) {
    return n === 1 ? 0.0 : (n - 1) * link[0] + (n - 1) / n * nbytes / link[1];
  }
  function p2pTime(nbytes, link) { return link[0] + nbytes / link[1]; }
  // step_time.dp_parts: [seconds, compute it can hide under, times per step, when it ends]
  function dpParts(m, l, hw, stage, compute) {
    var B = PRECISION_BYTES[l.precision], n = l.dp * l.cp;
    if (n === 1) return [];
    var link = l.dp > 1 ? axisLink(hw, l, "dp") : axisLink(hw, l, "cp");
    var nLayers = rankLayers(m.layers, l.pp, l.virtual_stages)[stage];
    var k = hw.bucketed ? 1 : (nLayers * tensorsPerLayer(m) + 2 * (stage === 0 ? 1 : 0) + 3 * (stage === l.pp - 1 ? 1 : 0));
    var fwd = compute / 3, bwd = 2 * compute / 3, mb = l.micro_batches, z = l.zero, parts = [];
    var params = stageParams(m, l, stage), bp = blockParams(m, l, stage), experts = bp[1];
    var kept = params - sum2(bp);
    var last = "after the last backward", later = "after the optimizer", inside = "in the pipeline";
    // the routed experts are replicated over dp·cp/ep ranks only
    [[params - experts, n, kept], [experts, floorDiv(n, l.ep), 0]].forEach(function (g) {
      var count = g[0], ranks = g[1], keptHere = g[2];
      if (ranks === 1 || count === 0) return;
      var gradBytes = count * B.grads, weightBytes = count * B.weights;
      var ar = function (b) { return k * allReduceTime(ranks, b / k, link); };
      var ag = function (b) { return k * gatherTime(ranks, b / k, link); };
      var rs = hw.backend === "gloo" ? ar : ag;   // gloo's reduce-scatter is a whole all-reduce
      if (z === 0) parts.push([ar(gradBytes), bwd, 1, last]);
      else if (z === 1) parts.push([rs(gradBytes), bwd, 1, last], [ag(weightBytes), fwd, 1, later]);
      else if (z === 2) parts.push([rs(gradBytes), bwd, mb - 1, inside], [rs(gradBytes), bwd, 1, last],
                                   [ag(weightBytes), fwd, 1, later]);
      else parts.push([ag(weightBytes), fwd, mb, inside], [ag(weightBytes - keptHere * B.weights) + rs(gradBytes), bwd, mb, inside]);
    });
    return parts;
  }
  // step_time.dp_traffic: [exposed, before hiding] of the parts that end `when` (all if undefined)
  function dpTraffic(m, l, hw, stage, compute, when) {
    var exposed = 0, all = 0;
    dpParts(m, l, hw, stage, compute).forEach(function (p) {
      if (when !== undefined && p[3] !== when) return;
      exposed += p[2] * Math.max(0.0, p[0] - hw.overlap * p[1]);
      all += p[2] * p[0];
    });
    return [exposed, all];
  }
  // step_time.after_the_pipeline: each stage's reduction in its cool-down, then every stage waits
  // for the others (global-norm clipping), then the slowest optimizer step and ZeRO's all-gather
  function afterThePipeline(m, l, hw, compute, backward) {
    var reductions = 0, update = -1, gather = 0, gathered = 0, before = 0;
    for (var s = 0; s < l.pp; s++) {
      var inside = dpTraffic(m, l, hw, s, compute, "in the pipeline");
      var last = dpTraffic(m, l, hw, s, compute, "after the last backward");
      var g = dpTraffic(m, l, hw, s, compute, "after the optimizer");
      var u = (hw.hbm ? optimizerTime(m, l, hw, s) : 0.0) + g[0];
      reductions = Math.max(reductions, inside[0] + Math.max(0.0, last[0] - s * backward));
      if (u > update || (u === update && (g[0] > gather || (g[0] === gather && g[1] > gathered)))) {
        update = u; gather = g[0]; gathered = g[1];
      }
      before = Math.max(before, inside[1] + last[1]);
    }
    return [reductions + gather, update - gather, before + gathered];
  }
  course.stepTime = function (model, layout, hw) {
    var m = shapeDefaults(model), l = layoutDefaults(layout);
    hw = Object.assign({ overhead: 0.0, step_overhead: 0.0, overlap: 0.0, bucketed: true, p2p: null,
                         ring_step: [0.0, 0.0], backend: "nccl", hbm: null, scores_in_hbm: false, ep_overlap: 0.0,
                         tp_overlap: 0.0, gemm_tiles: null }, hw);
    var B = PRECISION_BYTES[l.precision];
    var tokens = l.micro_batch * m.seq / l.cp, rc = l.recompute === "full" ? 1 : 0;
    var v = l.virtual_stages, sizes = rankLayers(m.layers, l.pp, v), worst = 0, best = -Infinity;
    for (var s = 0; s < l.pp; s++) {
      var key = sizes[s] + (s === l.pp - 1 ? 1 : 0) * m.vocab / (12 * m.hidden);
      if (key > best) { best = key; worst = s; }
    }
    var nLayers = sizes[worst], kinds = rankBlocks(m, l.pp, v)[worst];
    var matrixFlops = (6 + 2 * rc) * (kinds[0] * matrixPerToken(m, false) + kinds[1] * matrixPerToken(m, true));
    var attentionFlops = (12 + 4 * rc) * m.hidden * m.seq;
    var headFlops = worst === l.pp - 1 ? 6 * m.vocab * m.hidden : 0;
    var flops = tokens * (matrixFlops + nLayers * attentionFlops + headFlops) / l.tp;
    var gemmEff = gemmEfficiency(rankGemms(m, l, kinds[0], kinds[1], worst === l.pp - 1), hw, rc);
    var gemms = tokens * (matrixFlops + headFlops) / l.tp / (hw.flops * gemmEff);
    var attention = 0.0, compute;
    if (hw.attention === null || hw.attention === undefined) {
      compute = gemms + tokens * nLayers * attentionFlops / l.tp / hw.flops + nLayers * hw.overhead;
    } else {   // the FLOPs a causal FlashAttention kernel runs (step_time.attention_kernel_flops)
      var forward = 4 * m.hidden * m.seq;
      attention = tokens * nLayers * ((forward * (1 + rc) + 2.5 * forward) / 2) / l.tp / hw.attention;
      compute = gemms + attention + nLayers * hw.overhead;
    }
    var memory = hw.hbm ? memoryBoundTime(m, l, hw, kinds[0], kinds[1]) : 0.0;
    compute += memory;
    var act = tokens * m.hidden * B.act, tpLink = axisLink(hw, l, "tp");
    var seconds = {
      "all-reduce": function (b) { return allReduceTime(l.tp, b, tpLink); },
      "all-gather": function (b) { return gatherTime(l.tp, b, tpLink); },
      "reduce-scatter": function (b) { return hw.backend === "gloo" ? allReduceTime(l.tp, b, tpLink) : gatherTime(l.tp, b, tpLink); }
    };
    var tp = 0;
    tpCollectives(l, nLayers, worst === 0 ? 1 : 0, worst === l.pp - 1 ? 1 : 0, act, tokens, rc).forEach(function (op) {
      tp += op[2] * seconds[op[0]](op[1]);
    });
    tp = Math.max(0.0, tp - hw.tp_overlap * compute);
    var cp = 0.0;
    if (l.cp > 1 && l.cp_algorithm === "allgather") {   // K, V all-gathered; dK, dV reduce-scattered
      var kvAll = 2 * tokens * kvDim(m) * B.act / l.tp, cpLink = axisLink(hw, l, "cp");
      cp = nLayers * ((2 + rc) * gatherTime(l.cp, l.cp * kvAll, cpLink) + gatherTime(l.cp, l.cp * kvAll, cpLink));
    } else if (l.cp > 1) {
      var kv = 2 * tokens * kvDim(m) * B.act / l.tp, link = p2pLink(hw, l, "cp");
      var passes = p2pTime(kv, link) * (1 + rc) + 2 * p2pTime(kv, link);
      cp = nLayers * (l.cp - 1) * (passes + (1 + rc) * hw.ring_step[0] + hw.ring_step[1]);
    }
    var sends = l.pp > 1 ? 2 * v * p2pTime(l.sp ? act / l.tp : act, p2pLink(hw, l, "pp")) : 0.0;
    var ep = 0.0;
    if (kinds[1] && l.ep > 1) {   // dispatch and combine, forward and backward, per MoE block
      var copies = m.route_nodes ? Math.min(m.top_k, m.route_nodes) : m.top_k;
      var rows = tokens * copies * m.hidden * B.act / (l.sp ? l.tp : 1), epLink = axisLink(hw, l, "ep");
      ep = kinds[1] * (4 + 2 * rc) * ((l.ep - 1) * epLink[0] + (l.ep - 1) / l.ep * rows / epLink[1]);
      ep = Math.max(0.0, ep - hw.ep_overlap * compute);
    }
    var slot = compute + tp + cp + sends + ep, mb = l.micro_batches;
    var bubble = (l.pp - 1) / v * slot;
    // step_time.chunk_backward: one chunk's backward (2/3 of the work) and the send of its gradient
    var after = afterThePipeline(m, l, hw, compute, (2 * (slot - sends) / 3 + sends / 2) / v);
    var exposedDp = after[0], optimizer = after[1];
    return { total: mb * slot + bubble + exposedDp + optimizer + hw.step_overhead, compute: mb * compute, tp: mb * tp,
             cp: mb * cp, bubble: bubble, pp: mb * sends, dp: exposedDp, flops: flops * mb, attention: mb * attention,
             memory: mb * memory, ep: mb * ep, optimizer: optimizer, "dp before hiding": after[2],
             "gemm efficiency": gemmEff };
  };
  function blockGemms(m, l, moe) {   // step_time.block_gemms: [how many, rows, inputs, outputs, launched together, runs again]
    var rows = l.micro_batch * m.seq / l.cp, h = m.hidden, tp = l.tp, up = m.mlp_matrices - 1;
    var shapes = [[1, rows, h, (h + 2 * kvDim(m)) / tp, 1, true], [1, rows, h / tp, h, 1, true]];
    if (!moe) return shapes.concat([[1, rows, h, up * m.ffn / tp, 1, true], [1, rows, m.ffn / tp, h, 1, true]]);
    var f = m.expert_ffn, shared = m.shared_experts;
    shapes.push([1, rows, h, m.experts, 1, true]);
    if (shared) shapes.push([1, rows, h, up * shared * f / tp, 1, true], [1, rows, shared * f / tp, h, 1, true]);
    var routed = rows * m.top_k * l.ep / m.experts, local = floorDiv(m.experts, l.ep);
    return shapes.concat([[1, routed, h, up * f / tp, local, true], [1, routed, f / tp, h, local, true]]);
  }
  function rankGemms(m, l, dense, moe, last) {   // step_time.rank_gemms
    var shapes = [];
    if (dense) blockGemms(m, l, false).forEach(function (g) { shapes.push([dense * g[0]].concat(g.slice(1))); });
    if (moe) blockGemms(m, l, true).forEach(function (g) { shapes.push([moe * g[0]].concat(g.slice(1))); });
    if (last) shapes.push([1, l.micro_batch * m.seq / l.cp, m.hidden, m.vocab / l.tp, 1, false]);
    return shapes;
  }
  function waveEfficiency(rows, columns, tiles, group) {   // step_time.wave_efficiency
    var n = group * Math.ceil(rows / tiles[1]) * Math.ceil(columns / tiles[2]);
    return group * rows * columns / (Math.ceil(n / tiles[0]) * tiles[0] * tiles[1] * tiles[2]);
  }
  function gemmEfficiency(shapes, hw, rc) {   // step_time.gemm_efficiency
    if (hw.gemm_tiles === null || hw.gemm_tiles === undefined) return 1.0;
    var work = 0.0, seconds = 0.0;
    shapes.forEach(function (g) {
      var flops = g[0] * g[4] * g[1] * g[2] * g[3], t = hw.gemm_tiles;
      var forward = waveEfficiency(g[1], g[3], t, g[4]);   // then the input's gradient, then the weight's
      var effs = (rc && g[5] ? [forward, forward] : [forward]).concat(
        [waveEfficiency(g[1], g[2], t, g[4]), waveEfficiency(g[2], g[3], t, g[4])]);
      effs.forEach(function (e) { work += flops; seconds += flops / e; });
    });
    return work / seconds;
  }
  function memoryBoundTime(m, l, hw, dense, moe) {   // step_time.memory_bound_time
    var B = PRECISION_BYTES[l.precision].act, tokens = l.micro_batch * m.seq / l.cp;
    var passes = 3 + (l.recompute === "full" ? 1 : 0), act = m.mlp_matrices === 2 ? 2 : 3, total = 0.0;
    [[dense, false], [moe, true]].forEach(function (g) {
      if (!g[0]) return;
      var stream = 10 * m.hidden, split = g[1] ?
        act * m.expert_ffn * (m.top_k + m.shared_experts) + 4 * m.top_k * m.hidden : act * m.ffn;
      var scores = hw.scores_in_hbm ? 4 * m.heads * m.seq / l.cp : 0;
      var per = passes * ((l.sp ? stream / l.tp : stream) + (split + scores) / l.tp);
      if (l.recompute === "selective") per += 4 * m.hidden / (l.sp ? l.tp : 1) + split / l.tp;
      total += g[0] * per;
    });
    return tokens * total * B / hw.hbm;
  }
  function optimizerTime(m, l, hw, stage) {   // step_time.optimizer_time
    var B = PRECISION_BYTES[l.precision], n = stageParams(m, l, stage), experts = blockParams(m, l, stage)[1];
    var shard = l.zero ? l.dp * l.cp : 1;
    var updated = (n - experts) / shard + experts / (l.zero ? floorDiv(shard, l.ep) : 1);
    return updated * (B.grads + 2 * B.optimizer + B.weights) / hw.hbm;
  }
  function tpCollectives(l, nLayers, first, last, act, tokens, rc) {   // step_time.tp_collectives
    if (l.tp === 1) return [];
    var ops;
    if (l.sp) {
      ops = [["all-gather", act, nLayers * (6 + 2 * rc)], ["reduce-scatter", act, nLayers * (4 + 2 * rc)],
             ["reduce-scatter", act, first], ["all-gather", act, first],
             ["all-gather", act, 2 * last], ["reduce-scatter", act, last]];
    } else {
      ops = [["all-reduce", act, nLayers * (4 + 2 * rc) + first + last]];
    }
    return ops.concat([["all-reduce", tokens * 4, 3 * last]]);
  }

  var GiB = Math.pow(2, 30);
  function fmtBytes(x) {
    if (x >= GiB) return (x / GiB).toFixed(2) + " GiB";
    if (x >= Math.pow(2, 20)) return (x / Math.pow(2, 20)).toFixed(2) + " MiB";
    return (x / 1024).toFixed(1) + " KiB";
  }

  // The time bar's parts, in the order they are stacked; they add up to stepTime's total. The
  // port returns every part of step_time.py but its fixed cost per step (hw.step_overhead, which
  // step_time.py adds to the total as it is): that is charged the same way here, with the
  // optimizer step (zero unless the hardware has an HBM rate) as one part.
  var TIME_PARTS = [["compute", "compute", "#4c78a8"], ["bubble", "pipeline bubble", "#bab0ac"],
                    ["tp", "TP", "#f58518"], ["cp", "CP", "#72b7b2"], ["pp", "PP sends", "#54a24b"],
                    ["ep", "EP all-to-all", "#eeca3b"], ["dp", "exposed DP", "#e45756"],
                    ["fixed", "optimizer and fixed cost", "#b279a2"]];
  course.stepParts = function (st, hw) {   // [[key, label, seconds, colour]] of a stepTime result
    var fixed = st.optimizer + ((hw && hw.step_overhead) || 0.0);
    return TIME_PARTS.map(function (p) { return [p[0], p[1], p[0] === "fixed" ? fixed : st[p[0]], p[2]]; });
  };
  // one legend entry: a swatch, its name and its value, kept on one line and apart from the next
  function legendItem(legend, swatchClass, text) {
    var item = el("span", { "class": "legend-item" }, legend);
    el("span", { "class": "swatch " + swatchClass }, item).textContent = "■";
    item.appendChild(document.createTextNode(" " + text));
    legend.appendChild(document.createTextNode(" "));
  }

  function drawCalculator(root, data) {
    PRECISION_BYTES = data.precision_bytes;
    var body = root.querySelector(".widget-body");
    body.hidden = false;
    root.classList.add("live");
    var form = el("div", { "class": "widget-controls" }, body);
    function field(label, make) {
      var wrap = el("label", {}, form);
      wrap.appendChild(document.createTextNode(label + " "));
      return make(wrap);
    }
    function select(label, values, value) {
      return field(label, function (wrap) {
        var s = el("select", {}, wrap);
        values.forEach(function (v) { el("option", { value: v }, s).textContent = v; });
        s.value = value;
        return s;
      });
    }
    function number(label, value, min) {
      return field(label, function (wrap) {
        return el("input", { type: "number", min: String(min === undefined ? 1 : min), step: "1", value: value,
                             inputmode: "numeric" }, wrap);
      });
    }
    function check(label, value) {
      return field(label, function (wrap) {
        var c = el("input", { type: "checkbox" }, wrap);
        c.checked = value;
        return c;
      });
    }
    var presetNames = Object.keys(data.presets);
    var preset = select("model", presetNames.concat(["custom"]), data.initial.model);
    var shapeKeys = ["layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"];
    // a mixture of experts (0 experts: dense); these may be 0
    var moeKeys = ["experts", "top_k", "shared_experts", "expert_ffn", "dense_layers"];
    var shapeInputs = {};
    shapeKeys.forEach(function (k) { shapeInputs[k] = number(k, data.presets[data.initial.model][k]); });
    moeKeys.forEach(function (k) { shapeInputs[k] = number(k.replace("_", " "), data.presets[data.initial.model][k] || 0, 0); });
    var allShapeKeys = shapeKeys.concat(moeKeys);
    var L = data.initial.layout;
    var inp = {
      dp: number("dp", L.dp), ep: number("ep", L.ep || 1), tp: number("tp", L.tp), pp: number("pp", L.pp), cp: number("cp", L.cp),
      zero: select("ZeRO", [0, 1, 2, 3], L.zero), micro_batch: number("micro-batch", L.micro_batch),
      micro_batches: number("micro-batches", L.micro_batches),
      virtual_stages: number("virtual stages", L.virtual_stages || 1),
      recompute: select("recompute", ["none", "selective", "full"], L.recompute),
      cp_algorithm: select("CP algorithm", ["ring", "allgather"], L.cp_algorithm || "ring"),
      precision: select("precision", Object.keys(data.precision_bytes), L.precision),
      schedule: select("schedule", ["1f1b", "gpipe"], L.schedule), sp: check("SP", L.sp),
      memory: number("device GiB", data.initial.memory_gib, 0),
      hardware: select("step time on", Object.keys(data.hardware), Object.keys(data.hardware)[0])
    };
    var out = el("p", { "class": "widget-readout", "aria-live": "polite" }, body);
    // the memory bar and, beside it (below it on a phone), where the step's time goes
    var bars = el("div", { "class": "calc-bars" }, body);
    var barBox = el("div", { "class": "widget-svg" }, bars), timeBox = el("div", { "class": "widget-svg" }, bars);
    var stepOut = el("p", { "class": "widget-readout" }, body);
    var base = {};
    function loadPreset() {
      var p = data.presets[preset.value];
      if (!p) return;
      base = p;
      allShapeKeys.forEach(function (k) { shapeInputs[k].value = p[k] || 0; });
      // a smaller model cannot take the last one's tp or pp: keep the largest that still divides
      // its heads (and K/V heads) and its layers, so a preset never opens on "not a valid layout"
      var largestDivisor = function (n, atMost) {
        for (var d = Math.min(n, atMost); d > 1; d--) if (n % d === 0) return d;
        return 1;
      };
      var gcd = function (a, b) { return b ? gcd(b, a % b) : a; };
      inp.tp.value = largestDivisor(gcd(p.heads, p.kv_heads), +inp.tp.value);
      inp.pp.value = largestDivisor(p.layers, +inp.pp.value);
      inp.ep.value = p.experts ? largestDivisor(gcd(p.experts, +inp.dp.value), +inp.ep.value) : 1;
    }
    function model() {
      var m = {};
      Object.keys(base).forEach(function (k) { m[k] = base[k]; });
      allShapeKeys.forEach(function (k) { m[k] = +shapeInputs[k].value; });
      if (!m.experts) m.route_nodes = 0;   // not an input: a preset's routing goes with its experts
      return m;
    }
    function layout() {
      var l = {};
      ["dp", "ep", "tp", "pp", "cp", "zero", "micro_batch", "micro_batches", "virtual_stages"].forEach(function (k) { l[k] = +inp[k].value; });
      l.recompute = inp.recompute.value; l.precision = inp.precision.value; l.schedule = inp.schedule.value;
      l.cp_algorithm = inp.cp_algorithm.value;
      l.sp = inp.sp.checked && l.tp > 1;
      return l;
    }
    var PARTS = [["weights", "#4c78a8"], ["grads", "#f58518"], ["optimizer", "#54a24b"],
                 ["gathered", "#b279a2"], ["activations", "#e45756"]];
    function redraw() {
      var t0 = performance.now();
      var m = model(), l = layout(), problems = [];
      // what ModelShape and Layout refuse, then the rules lecture 07's search applies (valid_layouts);
      // a number must also stay a safe integer, so no product below overflows into Infinity or NaN
      var whole = function (x) { return x >= 1 && x % 1 === 0 && x <= 1e7; };
      shapeKeys.forEach(function (k) {
        if (!whole(m[k])) problems.push(k + " must be a whole number from 1 to 10,000,000");
      });
      moeKeys.forEach(function (k) {
        if (!(m[k] >= 0 && m[k] % 1 === 0 && m[k] <= 1e7)) problems.push(k.replace("_", " ") + " must be a whole number from 0 to 10,000,000");
      });
      ["dp", "ep", "tp", "pp", "cp", "micro_batch", "micro_batches", "virtual_stages"].forEach(function (k) {
        if (!whole(l[k])) problems.push(k.replace("_", "-") + " must be a whole number from 1 to 10,000,000");
      });
      var gib = +inp.memory.value;
      if (inp.memory.value === "" || !(gib >= 0 && gib <= 1e6)) problems.push("device GiB must be a number from 0 to 1,000,000");
      if (!problems.length) {
        if (m.hidden % m.heads) problems.push("hidden must be divisible by heads");
        if (m.heads % m.kv_heads) problems.push("heads must be divisible by K/V heads");
        if (m.heads % l.tp || m.kv_heads % l.tp) problems.push("tp must divide the heads and the K/V heads");
        if (l.pp * l.virtual_stages > m.layers) problems.push("pp × virtual stages must not exceed the layers (a block per chunk)");
        if (l.virtual_stages > 1 && (l.pp === 1 || l.schedule !== "1f1b")) problems.push("virtual stages interleave a 1F1B pipeline: pp > 1 and schedule 1f1b");
        if (l.cp > 1 && m.seq % (2 * l.cp)) problems.push("the sequence must split into 2·cp zig-zag chunks");
        if (l.pp > 1 && l.micro_batches < l.pp) problems.push("a pipeline needs at least pp micro-batches");
        if (!m.experts && (m.shared_experts || m.expert_ffn || m.dense_layers || m.top_k !== 1))
          problems.push("shared experts, expert ffn, dense layers and top k describe a mixture of experts: set experts ≥ 1");
        if (m.experts && !(m.top_k >= 1 && m.top_k <= m.experts && m.expert_ffn >= 1 && m.dense_layers < m.layers))
          problems.push("experts need 1 ≤ top k ≤ experts, expert ffn ≥ 1 and a block after the dense layers");
        if (l.dp % l.ep) problems.push("ep must divide dp (expert parallelism lives inside data parallelism)");
        else if (m.experts ? m.experts % l.ep : l.ep > 1) problems.push("ep must divide the routed experts");
      }
      barBox.innerHTML = "";
      timeBox.innerHTML = "";
      if (problems.length) {
        out.textContent = "Not a valid model or layout: " + problems.join("; ") + ".";
        stepOut.textContent = "";
        return;
      }
      var e = course.estimateMemory(m, l), cap = gib * GiB;
      var W = Math.max(300, Math.min(960, barBox.clientWidth || 720)), H = 68, left = 8;
      el("p", { "class": "widget-bar-title" }, barBox).textContent = "Memory per rank";
      var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "bytes per rank" }, barBox, true);
      var top = Math.max(e.total, cap) || 1, scale = (W - 2 * left) / top, x = left;
      PARTS.forEach(function (p) {
        var w = e[p[0]] * scale;
        if (w <= 0) return;
        var r = el("rect", { x: x, y: 10, width: w, height: 34, fill: p[1] }, svg, true);
        el("title", {}, r, true).textContent = p[0] + ": " + fmtBytes(e[p[0]]);
        x += w;
      });
      if (cap) {
        el("line", { x1: left + cap * scale, x2: left + cap * scale, y1: 4, y2: 50, stroke: "#000", "stroke-width": 2 }, svg, true);
        el("text", { x: Math.min(W - 4, left + cap * scale), y: 62, "font-size": 11, "text-anchor": "end" }, svg, true).textContent =
          "device " + fmtBytes(cap);
      }
      var legend = el("p", { "class": "widget-legend" }, barBox);
      PARTS.forEach(function (p) { legendItem(legend, "swatch-" + p[0], p[0] + " " + fmtBytes(e[p[0]])); });
      var fits = cap ? (e.total <= cap ? "fits" : "does NOT fit") : "";
      out.textContent = "Per rank (pipeline stage " + e.stage + ", the most loaded): " + fmtBytes(e.total) +
        (cap ? ", " + fits + " in " + fmtBytes(cap) : "") + "; " +
        (l.dp * l.tp * l.pp * l.cp) + " ranks, global batch " + (l.dp * l.micro_batch * l.micro_batches) + " sequences.";
      var hw = data.hardware[inp.hardware.value], st = course.stepTime(m, l, hw);
      var fmt = function (x) {   // below 0.1 ms in µs, so a small part never reads "0.0 ms"
        return x >= 1 ? x.toFixed(2) + " s" : x >= 1e-4 ? (1e3 * x).toFixed(1) + " ms" : (1e6 * x).toFixed(1) + " µs";
      };
      drawTimeBar(st, hw, fmt);
      // the bar's legend gives every part; the readout says only what the bar cannot show
      // the gradient sync runs over the dp·cp ranks that hold the same weights; ZeRO's gathers
      // hide behind forward, the reductions behind backward: "behind the compute"; with stages,
      // a later stage's once-a-step sync also waits in its cool-down (after_the_pipeline)
      var exposed = st.dp >= 1e-4 * st.total ? st.dp : 0;    // a few ns is "all hidden", not "0.0 µs"
      var behind = l.pp > 1 ? " behind the compute and the pipeline's cool-down" : " behind the compute";
      var dpWords = !(st["dp before hiding"] > 0) ? "no gradient sync (dp·cp = 1)" :
        "gradient sync over dp·cp ranks " + fmt(st["dp before hiding"]) +
        (exposed > 0 ? ", of which " + fmt(exposed) + " not hidden" + behind : ", all hidden" + behind);
      var inCompute = [st.attention > 0 ? "attention " + fmt(st.attention) : "",
                       st.memory > 0 ? "memory-bound work " + fmt(st.memory) : ""].filter(Boolean);
      stepOut.textContent = "Predicted step on " + hw.name + ": " + fmt(st.total) + " (" + dpWords +
        (inCompute.length ? "; of the compute: " + inCompute.join(", ") : "") + ").";
      var ms = performance.now() - t0;
      root.setAttribute("data-redraw-ms", ms.toFixed(3));
    }
    function drawTimeBar(st, hw, fmt) {   // the step's seconds, stacked part by part (stepParts)
      var W = Math.max(300, Math.min(960, timeBox.clientWidth || 720)), left = 8, x = left;
      el("p", { "class": "widget-bar-title" }, timeBox).textContent = "Predicted step " + fmt(st.total) + ": where it goes";
      var parts = course.stepParts(st, hw).filter(function (p) { return p[2] > 0; });
      var share = function (x) { return (100 * x / st.total).toFixed(0) + "%"; };
      var svg = el("svg", { viewBox: "0 0 " + W + " 50", role: "img", "aria-label": "seconds per step, by part",
                            "data-total": String(st.total) }, timeBox, true);
      var scale = (W - 2 * left) / (st.total || 1);
      parts.forEach(function (p) {
        var r = el("rect", { x: x, y: 10, width: p[2] * scale, height: 34, fill: p[3], "data-part": p[0],
                             "data-seconds": String(p[2]) }, svg, true);
        el("title", {}, r, true).textContent = p[1] + ": " + fmt(p[2]) + ", " + share(p[2]) + " of the step";
        x += p[2] * scale;
      });
      var legend = el("p", { "class": "widget-legend" }, timeBox);
      parts.forEach(function (p) { legendItem(legend, "swatch-time-" + p[0], p[1] + " " + fmt(p[2]) + " (" + share(p[2]) + ")"); });
    }
    preset.addEventListener("change", function () { loadPreset(); redraw(); });
    allShapeKeys.forEach(function (k) {
      shapeInputs[k].addEventListener("input", function () { preset.value = "custom"; redraw(); });
    });
    Object.keys(inp).forEach(function (k) {
      inp[k].addEventListener("input", redraw);
      inp[k].addEventListener("change", redraw);
    });
    loadPreset();
    redraw();
  }

  var DRAW = { "schedule-explorer": drawExplorer, "memory-calculator": drawCalculator };
  course.widgets = DRAW;
  Array.prototype.forEach.call(document.querySelectorAll("figure.widget[data-widget]"), function (root) {
    var draw = DRAW[root.getAttribute("data-widget")], src = root.querySelector("script.widget-data");
    if (!draw || !src) return;
    try {
      draw(root, JSON.parse(src.textContent));
    } catch (err) {
      root.classList.add("widget-error");
      var p = document.createElement("p");
      p.className = "quiet";
      p.textContent = "This interactive figure could not start (" + err.message + "); the static figures above show the same.";
      root.appendChild(p);
    }
  });
})();
