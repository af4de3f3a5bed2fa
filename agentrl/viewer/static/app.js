// agentrl view: plain JS, no libraries. State lives in the URL hash, so every view has a link.
"use strict";
const COLOURS = ["#3949ab", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#6d4c41", "#546e7a"];
const $ = (id) => document.getElementById(id);
const S = { runs: [], metrics: {}, step: null, shown: [] };

function getState() {
  const p = new URLSearchParams(location.hash.slice(1));
  return Object.fromEntries(p.entries());
}
// mode: undefined pushes a history entry (hashchange renders); "replace" rewrites it and renders; "quiet" only rewrites
function setState(patch, mode) {
  const st = Object.assign(getState(), patch);
  for (const k of Object.keys(st)) if (st[k] === "" || st[k] == null) delete st[k];
  const h = "#" + new URLSearchParams(st).toString();
  if (mode) history.replaceState(null, "", h); else location.hash = h;
  if (mode === "replace") render();
}
async function api(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()));
  return r.json();
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of kids.flat()) if (c != null) e.append(c.nodeType ? c : document.createTextNode(String(c)));
  return e;
}
const fmt = (x, d = 3) => (x == null ? "-" : Number(x).toFixed(d));
const signed = (x) => (x == null ? "-" : (x >= 0 ? "+" : "") + Number(x).toFixed(3));

// ----- runs and curves ------------------------------------------------------------------------
function chosenRuns() {
  const st = getState();
  return (st.runs ? st.runs.split(",").map(Number) : S.runs.map((r) => r.id)).filter((i) => S.runs[i]);
}
function drawRuns() {
  const on = new Set(chosenRuns()), box = $("runs");
  box.replaceChildren(...S.runs.map((r) => el("label", { title: r.path },
    el("input", { type: "checkbox", ...(on.has(r.id) ? { checked: "" } : {}), onchange: (ev) => {
      const now = new Set(chosenRuns()); ev.target.checked ? now.add(r.id) : now.delete(r.id);
      setState({ runs: [...now].sort().join(",") });
    } }),
    el("span", { class: "swatch", style: "background:" + COLOURS[r.id % COLOURS.length] }), r.name)));
}
function drawMetricChoices() {
  const keys = new Set();
  for (const rows of Object.values(S.metrics)) for (const r of rows) for (const [k, v] of Object.entries(r))
    if (typeof v === "number" && k !== "step") keys.add(k);
  const sel = $("metric"), st = getState(), want = st.metric || (keys.has("success") ? "success" : [...keys][0] || "");
  sel.replaceChildren(...[...keys].sort().map((k) => el("option", { value: k, ...(k === want ? { selected: "" } : {}) }, k)));
}
function drawChart() {
  const svg = $("chart"), st = getState(), metric = $("metric").value;
  const W = svg.clientWidth || 900, H = 240, L = 48, R = 36, T = 10, B = 26;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const series = chosenRuns().map((i) => ({ run: i, pts: (S.metrics[i] || []).filter((r) => typeof r[metric] === "number")
    .map((r) => [r.step, r[metric]]) })).filter((s) => s.pts.length);
  const all = series.flatMap((s) => s.pts);
  const NS = "http://www.w3.org/2000/svg", mk = (t, a) => { const e = document.createElementNS(NS, t);
    for (const [k, v] of Object.entries(a)) e.setAttribute(k, v); return e; };
  svg.replaceChildren();
  if (!all.length) { svg.append(mk("text", { x: L, y: H / 2 })); svg.lastChild.textContent = "no " + metric + " values"; return; }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.append(mk("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), mk("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const [v, y] of [[y0, Y(y0)], [(y0 + y1) / 2, Y((y0 + y1) / 2)], [y1, Y(y1)]]) {
    const t = mk("text", { x: L - 4, y: y + 3, "text-anchor": "end" }); t.textContent = Number(v.toPrecision(3)); svg.append(t);
  }
  for (const v of [x0, Math.round((x0 + x1) / 2), x1]) {
    const t = mk("text", { x: X(v), y: H - 8, "text-anchor": "middle" }); t.textContent = "step " + v; svg.append(t);
  }
  if (S.step != null) svg.append(mk("line", { class: "cursor", x1: X(S.step), x2: X(S.step), y1: T, y2: H - B }));
  const tip = $("tip");
  for (const s of series) {
    const c = COLOURS[s.run % COLOURS.length];
    svg.append(mk("path", { class: "curve", "data-run": s.run, stroke: c, d: s.pts.map((p, i) => (i ? "L" : "M") + X(p[0]) + "," + Y(p[1])).join(" ") }));
    for (const [x, y] of s.pts) {
      const dot = mk("circle", { class: "pt", cx: X(x), cy: Y(y), r: 3, fill: c });
      dot.addEventListener("mouseenter", () => { tip.hidden = false; tip.textContent = `${S.runs[s.run].name} step ${x}: ${metric} ${Number(y.toPrecision(4))}`;
        tip.style.left = (X(x) + 20) + "px"; tip.style.top = (Y(y) - 10) + "px"; });
      dot.addEventListener("mouseleave", () => { tip.hidden = true; });
      dot.addEventListener("click", () => setState({ run: s.run, step: x, group: "", ep: "" }));
      svg.append(dot);
    }
  }
}

// ----- steps, groups, filters -------------------------------------------------------------------
function currentRun() { const st = getState(); return S.runs[Number(st.run || chosenRuns()[0] || 0)]; }
async function drawSteps() {
  const run = currentRun(), st = getState(), split = st.split || "train";
  $("split").value = split;
  if (!run) return;
  const heads = await api(`/api/runs/${run.id}/steps?split=${split}`);
  const rows = Object.fromEntries((S.metrics[run.id] || []).map((r) => [r.step, r]));
  const key = split === "eval" ? "eval/success" : "success";
  $("step-list").replaceChildren(...heads.map((h) => el("button", { class: String(h.step) === st.step ? "on" : "",
    "data-step": h.step, onclick: () => setState({ run: run.id, step: h.step, group: "", ep: "" }) },
    "step " + h.step, el("span", { class: "rate" }, rows[h.step] && rows[h.step][key] != null ? fmt(rows[h.step][key], 2) : ""))));
  if (st.step == null && heads.length) setState({ run: run.id, step: heads[heads.length - 1].step }, "quiet");
}
function status(e) { return e.dropped ? "dropped" : e.filtered ? "filtered: " + e.filtered : ""; }
function keep(e) {
  const f = { outcome: $("f-outcome").value, env: $("f-env").value, min: $("f-min").value, max: $("f-max").value,
    status: $("f-status").value, q: $("f-search").value.trim().toLowerCase() };
  if (f.outcome === "won" && !e.won) return false;
  if (f.outcome === "lost" && e.won) return false;
  if (f.env && e.env !== f.env && e.category !== f.env) return false;
  if (f.min !== "" && e.turns.length < Number(f.min)) return false;
  if (f.max !== "" && e.turns.length > Number(f.max)) return false;
  if (f.status === "kept" && status(e)) return false;
  if (f.status === "dropped" && !status(e)) return false;
  if (f.q && !e.turns.some((t) => t.actions.join(" ").toLowerCase().includes(f.q) || t.text.toLowerCase().includes(f.q))) return false;
  return true;
}
async function loadStep() {
  const st = getState(), run = currentRun(), split = st.split || "train";
  if (!run || st.step == null) { S.data = null; return; }
  const key = run.id + ":" + split + ":" + st.step;
  if (S.key !== key) { S.data = await api(`/api/runs/${run.id}/step/${st.step}?split=${split}`); S.key = key; }
  S.step = Number(st.step);
}
function drawGroups() {
  const st = getState(), d = S.data, box = $("groups");
  if (!d) { box.replaceChildren(el("p", { class: "hint" }, "no recorded step")); return; }
  const envs = new Set(); for (const e of d.episodes) { envs.add(e.env); if (e.category) envs.add(e.category); }
  const fenv = $("f-env"), was = fenv.value;
  fenv.replaceChildren(el("option", { value: "" }, "every env / category"), ...[...envs].sort().map((v) => el("option", { value: v }, v)));
  fenv.value = envs.has(was) ? was : "";
  const groups = new Map(); d.episodes.forEach((e, i) => { if (!groups.has(e.group)) groups.set(e.group, []); groups.get(e.group).push([i, e]); });
  let shown = 0;
  const out = [];
  [...groups.entries()].forEach(([gid, eps], gi) => {
    const vis = eps.filter(([, e]) => keep(e));
    if (!vis.length) return;
    shown += vis.length;
    const won = eps.filter(([, e]) => e.won).length;
    out.push(el("div", { class: "group", "data-group": gi },
      el("h4", {}, `group ${gi} · ${eps[0][1].task_id} · won ${won}/${eps.length}`, eps[0][1].start_index ? el("span", { class: "badge replay" }, "restored prefix " + eps[0][1].start_index) : null),
      el("div", { class: "eps" }, vis.map(([i, e]) => {
        const adv = e.turns.length ? e.turns[0].advantage : null;
        return el("div", { class: `episode-card ${e.won ? "won" : "lost"} ${status(e) ? "off" : ""} ${String(i) === st.ep ? "on" : ""}`,
          "data-ep": i, onclick: () => setState({ group: gi, ep: i }) },
          el("div", {}, `#${i} ${e.won ? "won" : "lost"} r ${fmt(e.reward, 2)}`),
          el("div", {}, `adv ${signed(adv)} · ${e.turns.length} turns`),
          el("div", { class: "acts" }, e.turns.map((t) => t.actions.join("+") || "∅").join(" › ")),
          status(e) ? el("span", { class: "badge bad" }, status(e)) : null);
      }))));
  });
  $("step-head").replaceChildren(el("div", {}, `${d.split} step ${d.step}: ${groups.size} of ${d.groups_total} groups, ` +
    `${d.episodes.length} of ${d.episodes_total} episodes recorded; ${shown} shown`));
  box.replaceChildren(...out);
}

// ----- one episode as a conversation ----------------------------------------------------------------
function tokColour(mode, t, i) {
  if (mode === "logprob") { const p = Math.exp(t.logprobs[i] ?? 0); return `hsla(${Math.round(120 * p)}, 75%, 55%, .45)`; }
  if (mode === "advantage") { const a = t.advantage ?? 0, s = Math.min(1, Math.abs(a));
    return a >= 0 ? `rgba(46,125,50,${0.1 + 0.5 * s})` : `rgba(198,40,40,${0.1 + 0.5 * s})`; }
  if (mode === "version") { const v = t.versions ? t.versions[i] : t.policy_version; return `hsla(${(v * 47) % 360}, 70%, 60%, .45)`; }
  return "";
}
function agentText(t, mode) {
  if (!t.tokens || !mode) return el("div", { class: "text" }, t.text);
  return el("div", { class: "text" }, t.tokens.map((s, i) => el("span", { class: "tok", style: "background:" + tokColour(mode, t, i),
    title: `logp ${fmt(t.logprobs[i])} · v${t.versions ? t.versions[i] : t.policy_version}` }, s)));
}
function drawEpisode() {
  const st = getState(), d = S.data, box = $("episode");
  $("colour").value = st.colour ?? "logprob";
  const mode = $("colour").value;
  const e = d && st.ep != null ? d.episodes[Number(st.ep)] : null;
  $("permalink").href = location.href;
  if (!e) { box.replaceChildren(el("p", { class: "hint" }, "pick an episode")); return; }
  const kids = [el("div", { class: "ep-head" }, el("strong", {}, `task ${e.task_id}`), ` (${e.env}${e.category ? ", " + e.category : ""}, seed ${e.seed}) `,
    e.won ? "won" : "lost", ` · reward ${fmt(e.reward)} · score ${fmt(e.score, 2)}`, e.truncated ? el("span", { class: "badge" }, "truncated") : null,
    status(e) ? el("span", { class: "badge bad" }, status(e)) : null, e.notes && e.notes.replay ? el("span", { class: "badge replay" }, "replay") : null,
    e.error ? el("span", { class: "badge bad" }, e.error) : null)];
  if (e.instruction) kids.push(el("div", { class: "msg task" }, el("span", { class: "who" }, "task"), e.instruction));
  if (e.start_index) kids.push(el("div", { class: "msg prefix", "data-prefix": e.start_index },
    el("span", { class: "who" }, `restored prefix: ${e.start_index} env steps replayed, not generated`), e.prefix_actions.join(" › ")));
  kids.push(el("div", { class: "msg env" }, el("span", { class: "who" }, "env"), e.initial_observation));
  e.turns.forEach((t, k) => {
    kids.push(el("div", { class: "msg agent turn " + (t.format_ok ? "" : "badfmt"), "data-turn": k },
      el("span", { class: "who" }, `agent · turn ${k + 1}`),
      el("span", { class: "stats" }, ` advantage ${signed(t.advantage)}${t.return != null ? " · return " + fmt(t.return) : ""} · reward ${fmt(t.reward, 2)}` +
        ` · v${t.policy_version} · ${t.gen_tokens} tokens (prompt ${t.prompt_tokens}) · logp mean ${fmt(t.logprob_mean, 2)} min ${fmt(t.logprob_min, 2)}` +
        (t.parse_error ? " · " + t.parse_error : "") + (t.ineffective ? " · no effect" : "")),
      agentText(t, mode),
      t.actions.length ? el("div", {}, "actions: ", t.actions.map((a) => el("span", { class: "action" }, a)).reduce((acc, x) => acc.concat(acc.length ? [" ", x] : [x]), [])) : null,
      (t.tool_calls || []).map((c, j) => el("div", { class: "tool" }, "call " + JSON.stringify(c) + (t.tool_results && t.tool_results[j] != null ? "\n→ " + t.tool_results[j] : "")))));
    kids.push(el("div", { class: "msg env" }, el("span", { class: "who" }, "env" + (t.done ? " · done" : "")), t.observation));
  });
  box.replaceChildren(...kids);
}

// ----- wiring -------------------------------------------------------------------------------------
async function render() {
  try {
    drawRuns(); drawMetricChoices();
    await drawSteps(); await loadStep();
    drawChart(); drawGroups(); drawEpisode();
    for (const b of document.querySelectorAll("#step-list button")) b.classList.toggle("on", b.dataset.step === getState().step);
  } catch (err) { $("step-head").textContent = String(err); }
}
async function main() {
  S.runs = await api("/api/runs");
  for (const r of S.runs) S.metrics[r.id] = await api(`/api/runs/${r.id}/metrics`);
  const st = getState();
  for (const [id, k] of [["f-outcome", "outcome"], ["f-env", "env"], ["f-min", "min"], ["f-max", "max"], ["f-status", "status"], ["f-search", "q"]]) {
    if (st[k] != null) $(id).value = st[k];
    $(id).addEventListener("input", () => setState({ [k]: $(id).value }, "replace"));
  }
  $("metric").addEventListener("change", () => setState({ metric: $("metric").value }));
  $("split").addEventListener("change", () => setState({ split: $("split").value, step: "", group: "", ep: "" }));
  $("colour").addEventListener("change", () => setState({ colour: $("colour").value }));
  window.addEventListener("hashchange", render);
  window.addEventListener("resize", drawChart);
  await render();
  document.body.dataset.ready = "1";
}
main();
