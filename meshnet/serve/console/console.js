// The console's figures come as server-sent events from /console/events, read with fetch
// so that the API key goes in a header, as /v1's does; the chat streams /v1/chat/completions.
"use strict";
const $ = (id) => document.getElementById(id);
const mib = (bytes) => bytes == null ? "-" : (bytes / 1048576).toFixed(1) + " MiB";
const history = [];   // [seconds, tokens_total], the last five minutes
const conversation = [];
let feed = null;

function key() { return $("key").value.trim(); }
function headers() {
  const h = { "Content-Type": "application/json" };
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}
function text(tag, cls, content) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  el.textContent = content;
  return el;
}

function renderRoute(state) {
  const route = $("route");
  route.replaceChildren();
  state.stages.forEach((s, i) => {
    if (i > 0) {
      const seam = state.seams.find((m) => m.after === s.stage);
      route.append(text("div", "seam", seam ? `→ ${seam.hop_us_p50 ?? "-"} µs\n${seam.bytes_per_token ?? "-"} B/token` : "→"));
    }
    const box = document.createElement("div");
    box.className = "stage" + (s.in_route ? "" : " out") + (s.unreachable ? " silent" : "");
    box.dataset.stage = s.stage;
    box.append(text("div", "layers", s.stage), text("div", "host", `${s.host ?? "?"} · ${s.worker}`));
    box.append(text("div", "", `RSS ${mib(s.rss_bytes)}` + (s.device_bytes ? `, VRAM ${mib(s.device_bytes)}` : "")));
    box.append(text("div", "", `${s.backend ?? ""} ${s.device ?? ""}`.trim() || "-"));
    box.append(text("div", "", `sessions ${s.n_sessions ?? "-"}, queue ${s.queue_depth ?? "-"}`));
    if (s.state === "loading" || (s.load_progress != null && s.load_progress < 1)) {
      const bar = document.createElement("div");
      bar.className = "bar";
      const done = document.createElement("div");
      done.style.width = Math.round(100 * (s.load_progress || 0)) + "%";
      bar.append(done);
      box.append(text("div", "", `loading ${Math.round(100 * (s.load_progress || 0))}%`), bar);
    }
    if (s.unreachable) box.append(text("div", "error", "silent: " + s.unreachable));
    route.append(box);
  });
  $("route-error").textContent = state.route_error || "";
}

function renderFigures(state) {
  history.push([state.time, state.tokens_total]);
  while (history.length && history[0][0] < state.time - 300) history.shift();
  const last = history.length > 1 ? history[history.length - 2] : null;
  const tps = last ? (state.tokens_total - last[1]) / Math.max(state.time - last[0], 1e-3) : 0;
  $("tps").textContent = tps.toFixed(1);
  $("sessions").textContent = state.sessions_active;
  $("waiting").textContent = state.queued;
  $("wait").textContent = state.queue_wait_mean_s === null ? "-" : state.queue_wait_mean_s;
  $("queue").textContent = state.queue;
  $("prefix").textContent = state.prefix_hits;
  $("resumes").textContent = state.resumes ? state.resumes.count : 0;
  $("refusals").textContent = Object.entries(state.refusals).map(([k, v]) => `${k} ${v}`).join(", ");
  const list = $("failovers");
  list.replaceChildren(...state.failovers.slice().reverse().map((f) => text("li", "failover",
    `${new Date(f.at * 1000).toLocaleTimeString()}: session ${f.sid} lost ${f.stage} (${f.worker}), ` +
    `resumed in ${f.elapsed_ms} ms, ${f.replayed_tokens} tokens replayed`)));
  drawChart();
}

function drawChart() {
  const canvas = $("chart"), g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const rates = [];
  for (let i = 1; i < history.length; i++) {
    rates.push([history[i][0], (history[i][1] - history[i - 1][1]) / Math.max(history[i][0] - history[i - 1][0], 1e-3)]);
  }
  if (!rates.length) return;
  const top = Math.max(1, ...rates.map((r) => r[1])), now = rates[rates.length - 1][0];
  g.strokeStyle = "#3a6ea5";
  g.beginPath();
  rates.forEach(([t, r], i) => {
    const x = canvas.width * (1 - (now - t) / 300), y = canvas.height * (1 - r / top);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
  g.fillStyle = "#555";
  g.fillText(`${top.toFixed(0)} tok/s`, 4, 12);
}

function render(state) {
  $("model").textContent = state.model;
  const ready = state.route && state.route.length > 0;
  $("status").textContent = state.error ? "error" : ready ? "ready" : "no route";
  $("status").className = "status " + (ready ? "ready" : "no_route");
  renderRoute(state);
  renderFigures(state);
}

// server-sent events over fetch: the data of each "data: ...\n\n" record
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const record = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      if (record.startsWith("data: ")) yield record.slice(6);
    }
  }
}

async function follow() {
  if (feed) feed.abort();
  feed = new AbortController();
  try {
    const response = await fetch("/console/events", { headers: headers(), signal: feed.signal });
    if (!response.ok) {
      $("status").textContent = response.status === 401 ? "API key?" : "error " + response.status;
      return;
    }
    for await (const data of events(response)) render(JSON.parse(data));
  } catch (e) {
    if (e.name === "AbortError") return;
  }
  setTimeout(follow, 1000);   // the server went away: try again
}

async function send(event) {
  event.preventDefault();
  const content = $("message").value.trim();
  if (!content) return;
  $("message").value = "";
  conversation.push({ role: "user", content });
  $("transcript").append(text("div", "user", "> " + content));
  const answer = text("div", "assistant", "");
  $("transcript").append(answer);
  const body = { model: $("model").textContent, messages: conversation, stream: true,
                 max_tokens: Number($("max-tokens").value) || 64 };
  const temperature = Number($("temperature").value);
  if (temperature > 0) { body.temperature = temperature; body.seed = Number($("seed").value) || 0; }
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) { answer.textContent = "error: " + (await response.text()); answer.className = "error"; return; }
  for await (const data of events(response)) {
    if (data === "[DONE]") continue;
    const chunk = JSON.parse(data);
    if (chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content) answer.textContent += chunk.choices[0].delta.content;
  }
  answer.dataset.done = "true";
  conversation.push({ role: "assistant", content: answer.textContent });
}

$("key").value = localStorage.getItem("meshnet-key") || new URLSearchParams(location.hash.slice(1)).get("key") || "";
$("key").addEventListener("change", () => { localStorage.setItem("meshnet-key", key()); follow(); });
$("chat-form").addEventListener("submit", send);
follow();
