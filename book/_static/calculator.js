/* The page "Try the calculator" (book/calculator.md): reads the form into the command line's words, runs
   helpers.cost.calculator.page(words) in Pyodide, and draws the report it returns. No arithmetic here: every
   number on the page is one the Python computed (`python -m helpers.cost.calculator --json` prints the same).
   helpers/tools/calculator_site.py writes _static/calculator/ (Pyodide, its runtime, the Python sources). */
(function () {
  "use strict";
  const here = document.currentScript.src;
  const root = here.replace(/_static\/calculator\.js.*$/, "");
  const $ = (id) => document.getElementById(id);
  let calculator = null;

  function decode(b64) {
    const text = atob(b64), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return bytes;
  }

  // A page opened from a disk (file://) may load scripts but not fetch files: Pyodide's three fetches
  // (its WebAssembly, its standard library, its lock file) are answered from runtime.js instead.
  const fetchElsewhere = window.fetch.bind(window);
  window.fetch = function (resource, options) {
    const url = String(resource instanceof Request ? resource.url : resource);
    const name = url.slice(url.lastIndexOf("/") + 1);
    const runtime = window.calculatorRuntime || {};
    if (url.includes("/_static/calculator/") && Object.prototype.hasOwnProperty.call(runtime, name)) {
      const type = name.endsWith(".wasm") ? "application/wasm"
        : name.endsWith(".json") ? "application/json" : "application/zip";
      return Promise.resolve(new Response(decode(runtime[name]), {status: 200, headers: {"Content-Type": type}}));
    }
    return fetchElsewhere(resource, options);
  };

  function words() {
    const out = [];
    for (const el of document.querySelectorAll("#calc-form [data-flag]")) {
      if (el.type === "checkbox") { if (el.checked) out.push(el.dataset.flag); }
      else if (el.value.trim() !== "") out.push(el.dataset.flag, el.value.trim());
    }
    return out;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const c of children) node.append(c instanceof Node ? c : String(c));
    return node;
  }

  function chapter(nn) {
    const page = window.calculatorSources.chapters[nn];
    return page ? el("a", {href: root + page, class: "calc-chapter"}, "ch. " + nn) : "ch. " + nn;
  }

  const gb = (bytes) => (bytes / 1e9).toFixed(2) + " GB";
  const sec = (s) => s.toFixed(2) + " s";

  function row(label, value, fraction, key, exact, link) {
    const bar = el("span", {class: "calc-bar"});
    bar.style.width = Math.max(0, Math.min(100, 100 * fraction)).toFixed(1) + "%";
    return el("div", {class: "calc-row", "data-key": key, "data-exact": exact},
      el("span", {class: "calc-label"}, label), el("span", {class: "calc-track"}, bar),
      el("span", {class: "calc-value"}, value), el("span", {class: "calc-link"}, link || ""));
  }

  function drawBudget(r) {
    const out = $("calc-result");
    out.replaceChildren();
    const m = r.model;
    out.append(el("p", {}, `${m.name}: ${(m.params / 1e9).toFixed(2)} B parameters` +
      (m.experts ? `, ${(m.active_params / 1e9).toFixed(2)} B active` : "") +
      (m.published ? ` (published: ${m.published.total / 1e9} B, the count ${(100 * m.published.gap).toFixed(1)} %` +
        (m.experts ? `; ${m.published.active / 1e9} B active, ${(100 * m.published.active_gap).toFixed(1)} %` : "") +
        (m.published.note ? `; ${m.published.note}` : "") + ")" : "") +
      `, on ${r.cluster.gpus} × ${r.cluster.gpu.toUpperCase()}; ${r.micro_batches} micro-batches per step.`));
    const mem = el("div", {class: "calc-block", id: "calc-memory"}, el("h3", {}, "Memory per GPU (busiest stage)"));
    for (const [k, v] of Object.entries(r.memory)) {
      mem.append(row(k, gb(v.bytes), v.bytes / r.gpu_memory, k, v.bytes, chapter(v.chapter)));
    }
    mem.append(row("total", gb(r.memory_total), r.memory_total / r.gpu_memory, "total", r.memory_total,
      `of ${(r.gpu_memory / 1e9).toFixed(0)} GB: ${r.fits ? "fits" : "does not fit"}`));
    out.append(mem);
    if (Object.keys(r.traffic).length) {
      const tr = el("div", {class: "calc-block", id: "calc-traffic"}, el("h3", {}, "Traffic per GPU per step"));
      const most = Math.max(...Object.values(r.traffic).map((v) => v.bytes));
      for (const [k, v] of Object.entries(r.traffic)) {
        tr.append(row(`${k} (${v.link})`, gb(v.bytes), v.bytes / most, k, v.bytes, chapter(v.chapter)));
      }
      out.append(tr);
    }
    const st = el("div", {class: "calc-block", id: "calc-step"}, el("h3", {}, "Step time"));
    for (const [k, v] of Object.entries(r.step)) {
      st.append(row(k, sec(v), v / r.step_seconds, k, v, chapter(r.step_chapters[k])));
    }
    st.append(row("step", sec(r.step_seconds), 1, "step", r.step_seconds, ""));
    st.append(row("MFU", (100 * r.mfu).toFixed(1) + " %", r.mfu, "mfu", r.mfu, chapter("01")));
    out.append(st);
  }

  function drawSearch(r) {
    const out = $("calc-search");
    out.replaceChildren(el("h3", {}, "The fastest layouts that fit"));
    const list = el("ol", {});
    for (const c of r.search) {
      list.append(el("li", {"data-exact": c.step_seconds}, el("code", {}, c.describe),
        el("br"), `step ${sec(c.step_seconds)}, MFU ${(100 * c.mfu).toFixed(1)} %, ${gb(c.memory_total)} per GPU: ${c.why}`));
    }
    out.append(list);
  }

  function compute(extra) {
    const w = words().concat(extra || []);
    $("calc-command").textContent = "python -m helpers.cost.calculator " + w.join(" ");
    const r = JSON.parse(calculator.page(JSON.stringify(w)));
    const target = extra ? $("calc-search") : $("calc-result");
    if (r.error) {
      target.replaceChildren(el("p", {class: "calc-error"}, r.error));
      target.dataset.state = "error";
      return;
    }
    (extra ? drawSearch : drawBudget)(r);
    target.dataset.state = "done";
    if (!document.body.dataset.calculatorFirstResultMs) {
      document.body.dataset.calculatorFirstResultMs = performance.now().toFixed(0);
    }
  }

  function later(status, work) {
    $("calc-status").textContent = status;
    setTimeout(() => { work(); $("calc-status").textContent = "Ready."; }, 20);
  }

  async function start() {
    const sources = window.calculatorSources;
    $("calc-status").textContent = `Loading Python (Pyodide ${sources.version}) in this page…`;
    const pyodide = await loadPyodide({indexURL: root + "_static/calculator/"});
    performance.mark("calculator: Pyodide started");
    for (const [path, text] of Object.entries(sources.sources)) {
      pyodide.FS.mkdirTree("/calculator/" + path.slice(0, path.lastIndexOf("/")));
      pyodide.FS.writeFile("/calculator/" + path, text);
    }
    pyodide.runPython("import sys; sys.path.insert(0, '/calculator')");
    calculator = pyodide.pyimport("helpers.cost.calculator");
    performance.mark("calculator: modules imported");
    $("calc-compute").disabled = $("calc-search-button").disabled = false;
    $("calc-form").addEventListener("submit", (e) => { e.preventDefault(); later("Computing…", () => compute()); });
    $("calc-search-button").addEventListener("click", () => later("Searching every layout…",
      () => compute(["--search", "--top", "5"])));
    compute();
    $("calc-status").textContent = "Ready.";
  }

  function fillChoices() {  // the command line's own choices (argparse's), written by the build
    for (const sel of document.querySelectorAll("#calc-form select[data-flag]")) {
      const options = window.calculatorSources.choices[sel.dataset.flag] || [];
      if (sel.dataset.flag === "--model") sel.append(el("option", {value: ""}, "a custom shape (below)"));
      for (const c of options) sel.append(el("option", {value: c}, c));
      sel.value = sel.dataset.default || options[0];
    }
  }

  document.addEventListener("DOMContentLoaded", () => { fillChoices(); }, {once: true});
  document.addEventListener("DOMContentLoaded", () => start().catch((e) => {
    $("calc-status").textContent = "The calculator could not start: " + e;
  }));
})();
