// The playground page: controls, pills, status bar, loss chart. Everything heavy runs in worker.js.
// `?backend=cpu` forces the wasm CPU backend; `?backend=gpu` WebGPU even on a software adapter.

const $ = (id) => document.getElementById(id);
const worker = new Worker('worker.js', { type: 'module' });
let nextId = 1;
const waiting = new Map();

function call(cmd, args) {
  const id = nextId++;
  return new Promise((resolve, reject) => {
    waiting.set(id, { resolve, reject });
    worker.postMessage({ id, cmd, args });
  });
}

function status(text, error = false) {
  $('status').textContent = text;
  $('status').classList.toggle('error', error);
}

function consoleLine(line) {
  console.log(line);
  const c = $('console');
  c.textContent += line + '\n';
  c.scrollTop = c.scrollHeight;
}

worker.onmessage = (e) => {
  const m = e.data;
  if (m.event === 'log') return consoleLine(m.line);
  if (m.event === 'text') {
    const el = $(m.target === 'chat' ? 'chat-output' : 'output');
    el.textContent += m.text;
    el.scrollTop = el.scrollHeight;
    return;
  }
  if (m.event === 'progress') {
    return status(m.total ? `${m.what}: ${Math.round((100 * m.done) / m.total)}%` : `${m.what}…`);
  }
  if (m.event === 'gated') {
    // Background gating of the chat's model finished (the chat moves at its next token).
    const info = $('gguf-info');
    info.textContent = info.textContent.replace(/ · [^·]*$/, ` · ${m.paths.length ? m.paths.join(' + ') : 'f32 path'}`);
    return status(m.line);
  }
  if (m.event === 'device-lost') {
    consoleLine(`[ops] the GPU device was lost (${m.message}) — continuing on the CPU (wasm)`);
    $('backend').textContent = 'CPU (wasm)';
    return status('the GPU device was lost: continuing on the CPU (wasm)', true);
  }
  const w = waiting.get(m.id);
  if (!w) return;
  waiting.delete(m.id);
  if (m.ok) w.resolve(m.result);
  else w.reject(new Error(m.error));
};
worker.onerror = (e) => status(`the engine failed to start: ${e.message}`, true);

// ---- pills ------------------------------------------------------------------------------------------
function showPills(pills, webnn) {
  const box = $('pills');
  box.textContent = '';
  for (const p of [...pills, webnn]) {
    const s = document.createElement('span');
    s.className = 'pill';
    s.dataset.path = p.path;
    s.dataset.active = String(p.active);
    s.title = p.active ? `${p.path}: passed its numerics gate — in use` : (p.reason ?? 'off');
    s.textContent = p.active ? p.pill : `-${p.pill.replace(/^\+/, '')}`;
    box.appendChild(s);
  }
}

// WebNN: detected here; TinyGPT has no WebNN path yet, so the pill stays off either way, with the reason.
async function webnnPill() {
  const pill = { path: 'webnn', pill: '+webnn', active: false };
  if (!('ml' in navigator)) return { ...pill, reason: 'this browser has no WebNN (navigator.ml)' };
  try {
    await navigator.ml.createContext();
    return { ...pill, reason: 'WebNN is available, but TinyGPT has no WebNN kernels yet' };
  } catch (e) {
    return { ...pill, reason: String(e.message ?? e) };
  }
}

function describePaths(pills) {
  const on = pills.filter((p) => p.active).map((p) => p.path);
  return on.length ? `${on.join(' + ')} matmul active` : 'f32 path';
}

let webnn;
let pillsNow = [];

async function boot() {
  const query = new URLSearchParams(location.search);
  let backend = query.get('backend') ?? 'auto';
  if (!['auto', 'gpu', 'cpu'].includes(backend)) backend = 'auto';
  // ?drift-check=N: the drift guard checks one generated token in N on the f32 path (0: off), as
  // `tinygpt --drift-check N` does; 128 by default.
  let driftCheck = null;
  const driftParam = query.get('drift-check');
  if (driftParam !== null) {
    if (/^\d{1,9}$/.test(driftParam)) {
      driftCheck = Number(driftParam);
      consoleLine(`[ops] drift guard: ${driftCheck === 0 ? 'off (?drift-check=0)' : `every ${driftCheck} tokens on fast paths (?drift-check=${driftCheck})`}`);
    } else {
      consoleLine(`[ops] ?drift-check=${driftParam} is not a whole number of tokens (0: off): the default, 128, is used`);
    }
  }
  if (backend !== 'cpu' && !('gpu' in navigator)) {
    consoleLine('[ops] this browser has no WebGPU (navigator.gpu) — running on the CPU (wasm)');
    backend = 'cpu';
  }
  webnn = await webnnPill();
  status('gating the fast paths…');
  const t0 = performance.now();
  let r;
  try {
    r = await call('init', { backend, driftCheck });
  } catch (e) {
    return status(`the engine failed to start: ${e.message}`, true);
  }
  $('backend').textContent = r.backend;
  pillsNow = r.pills;
  showPills(r.pills, webnn);
  if (r.fallback) consoleLine(`[ops] ${r.fallback}`);
  try {
    await call('loadBundled');
  } catch (e) {
    return status(`the bundled model did not load: ${e.message}`, true);
  }
  const secs = ((performance.now() - t0) / 1000).toFixed(1);
  const where = r.backend === 'CPU (wasm)'
    ? `CPU (wasm)${r.fallback ? ` — ${r.fallback}` : ''}`
    : describePaths(pillsNow);
  status(`inference warmed up in ${secs}s · ${where} — ready to generate.`);
  $('generate').disabled = false;
}

// ---- sampling ---------------------------------------------------------------------------------------
$('generate').disabled = true;
$('generate').onclick = async () => {
  $('output').textContent = '';
  $('gen-stats').textContent = '';
  $('generate').disabled = true;
  $('generate-stop').disabled = false;
  try {
    const r = await call('generate', {
      prompt: $('prompt').value,
      n: Number($('length').value),
      temperature: Number($('temperature').value),
      topK: Number($('top-k').value),
      seed: Number($('seed').value),
    });
    $('output').textContent = $('prompt').value + $('output').textContent;
    const checks = r.drift_checks > 0 ? ` · drift guard: ${r.drift_checks} check${r.drift_checks === 1 ? '' : 's'} on the f32 path so far` : '';
    $('gen-stats').textContent = `${r.tokens} characters in ${r.seconds.toFixed(2)} s (${r.tokens_per_s.toFixed(1)} tokens/s)${checks}`;
    if (r.drift) {
      // The drift guard moved the model to the f32 path mid-generation.
      consoleLine(r.drift.line);
      status(r.drift.line, true);
    }
  } catch (e) {
    status(e.message, true);
  } finally {
    $('generate').disabled = false;
    $('generate-stop').disabled = true;
  }
};
$('generate-stop').onclick = () => call('stop');

// ---- training ---------------------------------------------------------------------------------------
const PRESETS = {
  // tiny: 256 tokens a step, so even a software adapter takes a step in seconds.
  tiny: { n_layer: 2, n_head: 2, n_embd: 64, block_size: 32, batch_size: 8, dropout: 0, lr: 3e-3, min_lr: 3e-4, warmup: 10, max_iters: 300 },
  small: { n_layer: 4, n_head: 4, n_embd: 128, block_size: 128, batch_size: 32, dropout: 0.1, lr: 2e-3, min_lr: 2e-4, warmup: 50, max_iters: 1000 },
  nanogpt: { n_layer: 6, n_head: 6, n_embd: 384, block_size: 256, batch_size: 64, dropout: 0.2, lr: 1e-3, min_lr: 1e-4, warmup: 100, max_iters: 5000 },
};
$('train-preset').onchange = () => { $('train-iters').value = PRESETS[$('train-preset').value].max_iters; };
const train = { running: false, paused: false, losses: [], vals: [] };

function drawChart() {
  const c = $('loss-chart');
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  const all = [...train.losses, ...train.vals];
  if (!all.length) return;
  const maxIt = Math.max(...all.map((p) => p[0]), 1);
  const lo = Math.min(...all.map((p) => p[1]));
  const hi = Math.max(...all.map((p) => p[1]));
  const x = (it) => 40 + ((c.width - 50) * it) / maxIt;
  const y = (v) => 10 + ((c.height - 30) * (hi - v)) / Math.max(hi - lo, 1e-6);
  g.fillStyle = '#6b7280';
  g.font = '11px sans-serif';
  g.fillText(hi.toFixed(2), 2, 14);
  g.fillText(lo.toFixed(2), 2, c.height - 20);
  g.fillText(`iter ${maxIt}`, c.width - 60, c.height - 4);
  for (const [pts, color] of [[train.losses, '#2563eb'], [train.vals, '#dc2626']]) {
    g.strokeStyle = color;
    g.beginPath();
    pts.forEach(([it, v], i) => (i ? g.lineTo(x(it), y(v)) : g.moveTo(x(it), y(v))));
    g.stroke();
  }
}

function trainLog(line) {
  const el = $('train-log');
  el.textContent += line + '\n';
  el.scrollTop = el.scrollHeight;
}

async function trainingText() {
  const src = $('train-source').value;
  if (src === 'paste') return $('train-text').value;
  if (src === 'file') {
    const f = $('train-file').files[0];
    if (!f) throw new Error('choose a text file to train on');
    return await f.text();
  }
  return await call('bundledText');
}

$('train-start').onclick = async () => {
  const preset = { ...PRESETS[$('train-preset').value], max_iters: Number($('train-iters').value) };
  let info;
  try {
    info = await call('trainStart', { preset, text: await trainingText() });
  } catch (e) {
    return status(`cannot train: ${e.message}`, true);
  }
  train.running = true;
  train.paused = false;
  train.losses = [];
  train.vals = [];
  $('train-log').textContent = '';
  trainLog(`training ${(info.params / 1e6).toFixed(2)}M parameters on ${info.train_chars} characters (vocabulary ${info.vocab})`);
  for (const id of ['train-pause', 'train-stop', 'download-checkpoint']) $(id).disabled = false;
  $('train-start').disabled = true;
  const evalEvery = Math.max(10, Math.round(preset.max_iters / 10));
  try {
    while (train.running) {
      if (train.paused) { await new Promise((r) => setTimeout(r, 100)); continue; }
      const r = await call('trainSteps', { k: 1 });
      train.losses.push([r.iter, r.loss]);
      const eta = ((r.max_iters - r.iter) * r.ms_per_iter) / 1000;
      status(`training: iter ${r.iter}/${r.max_iters} · loss ${r.loss.toFixed(4)} · ${Math.round(r.tokens_per_s)} tokens/s · ${r.ms_per_iter.toFixed(0)} ms/iter · ETA ${eta.toFixed(0)} s`);
      if (r.iter % 10 === 0 || r.done) trainLog(`iter ${r.iter}: loss ${r.loss.toFixed(4)} (${Math.round(r.tokens_per_s)} tokens/s)`);
      if (r.iter % evalEvery === 0 || r.done) {
        const v = await call('trainEval', { batches: 4 });
        train.vals.push([v.iter, v.val_loss]);
        trainLog(`iter ${v.iter}: val loss ${v.val_loss.toFixed(4)}`);
      }
      drawChart();
      if (r.done) break;
    }
    trainLog(train.running ? 'done' : 'stopped');
    status('training finished: sample from it, or download the checkpoint');
  } catch (e) {
    status(`training stopped: ${e.message} (the last checkpoint can still be downloaded)`, true);
  } finally {
    train.running = false;
    $('train-start').disabled = false;
    $('train-pause').disabled = true;
    $('train-stop').disabled = true;
    $('train-use').disabled = false;
  }
};
$('train-pause').onclick = () => {
  train.paused = !train.paused;
  $('train-pause').textContent = train.paused ? 'resume' : 'pause';
};
$('train-stop').onclick = () => { train.running = false; };
$('train-use').onclick = async () => {
  try {
    await call('trainUse');
    status('sampling from the model you trained');
  } catch (e) { status(e.message, true); }
};
$('download-checkpoint').onclick = async () => {
  try {
    const bytes = await call('trainCheckpoint');
    const url = URL.createObjectURL(new Blob([bytes], { type: 'application/zip' }));
    const a = document.createElement('a');
    a.href = url;
    a.download = 'tinygpt-checkpoint.zip';
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (e) { status(e.message, true); }
};
$('upload-checkpoint').onchange = async (e) => {
  const f = e.target.files[0];
  if (!f) return;
  try {
    const info = await call('loadCheckpoint', { file: f });
    status(`loaded ${f.name} (${(info.params / 1e6).toFixed(2)}M parameters): sample from it above`);
  } catch (err) { status(`cannot load ${f.name}: ${err.message}`, true); }
};

// ---- GGUF chat --------------------------------------------------------------------------------------
async function loadGguf(file) {
  $('chat-output').textContent = '';
  $('gguf-info').textContent = '';
  try {
    const t0 = performance.now();
    const info = await call('loadGguf', { file });
    const paths = info.gating ? 'f32 path, fast paths gating…' : (info.paths.length ? info.paths.join(' + ') : 'f32 path');
    $('gguf-info').textContent = `${info.name}: ${info.arch}, ${info.layers} layers, vocabulary ${info.vocab}, ${info.weights_mb.toFixed(0)} MB of weights, context ${info.context} · ${paths}`;
    const gating = info.gating ? ' (on the f32 path while the fast paths are gated in the background)' : '';
    status(`${info.name} loaded in ${((performance.now() - t0) / 1000).toFixed(1)} s — ready to chat${gating}.`);
    for (const id of ['chat-input', 'chat-send', 'chat-reset']) $(id).disabled = false;
  } catch (e) {
    status(`cannot load ${file.name}: ${e.message}`, true);
  }
}
$('gguf-file').onchange = (e) => e.target.files[0] && loadGguf(e.target.files[0]);
const drop = $('drop');
drop.ondragover = (e) => { e.preventDefault(); drop.classList.add('over'); };
drop.ondragleave = () => drop.classList.remove('over');
drop.ondrop = (e) => {
  e.preventDefault();
  drop.classList.remove('over');
  const f = e.dataTransfer.files[0];
  if (f) loadGguf(f);
};

async function send() {
  const message = $('chat-input').value;
  if (!message.trim()) return;
  $('chat-input').value = '';
  $('chat-output').textContent += `\n> ${message}\n`;
  $('chat-send').disabled = true;
  $('chat-stop').disabled = false;
  try {
    const r = await call('chatSend', {
      message,
      maxTokens: Number($('chat-max-tokens').value),
      temperature: Number($('chat-temperature').value),
      seed: 1337,
    });
    $('chat-output').textContent += '\n';
    const drift = r.drift ? ` · ${r.drift.line}` : '';
    const moved = r.moved ? ` · moved to ${r.moved.paths.join(' + ')} at position ${r.moved.position}` : '';
    if (r.moved) consoleLine(`[ops] the chat moved to ${r.moved.paths.join(' + ')} at position ${r.moved.position}`);
    status(`${r.tokens} tokens in ${r.seconds.toFixed(2)} s (${r.tokens_per_s.toFixed(1)} tokens/s; prompt ${r.prompt_tokens} tokens in ${r.prompt_seconds.toFixed(2)} s) · ${r.finish}${moved}${drift}`, Boolean(r.drift));
  } catch (e) {
    status(e.message, true);
  } finally {
    $('chat-send').disabled = false;
    $('chat-stop').disabled = true;
  }
}
$('chat-send').onclick = send;
$('chat-input').onkeydown = (e) => { if (e.key === 'Enter') send(); };
$('chat-stop').onclick = () => call('stop');
$('chat-reset').onclick = async () => { await call('chatReset'); $('chat-output').textContent = ''; };

// ---- gates ------------------------------------------------------------------------------------------
$('regate').onclick = async () => {
  status('re-running every gate…');
  try {
    pillsNow = await call('regate');
    showPills(pillsNow, webnn);
    await call('loadBundled');
    status(`gates re-run · ${describePaths(pillsNow)} — ready to generate.`);
  } catch (e) { status(e.message, true); }
};
// The local telemetry, summarised as `tinygpt gates --history` does: per adapter and path, the gate
// runs that measured (verdicts from the cache are not counted), passes, failures, the worst figure
// (max_abs over its limit, at any shape) and when; then the drift-guard events. Nothing leaves the page.
$('history').onclick = async () => {
  const h = await call('history');
  const per = {};
  const drifts = h.filter((rec) => rec.kind === 'drift');
  const runs = h.filter((rec) => rec.kind !== 'drift');
  const iso = (t) => new Date(t * 1000).toISOString();
  // Browsers may hide the adapter's name (WebGPU's adapter info can be empty).
  const adapterOf = (rec) => rec.adapter || rec.driver || 'WebGPU adapter';
  for (const rec of runs) {
    for (const p of rec.paths ?? []) {
      if (p.from_cache || p.status === 'unsupported') continue;
      const k = `${adapterOf(rec)} · ${p.name}`;
      per[k] ??= { runs: 0, pass: 0, fail: 0, worst: 0, last: 0 };
      const v = per[k];
      v.runs += 1;
      if (p.status === 'active') v.pass += 1;
      if (p.status === 'rejected') v.fail += 1;
      for (const s of p.shapes ?? []) {
        if (s.limit_abs > 0) v.worst = Math.max(v.worst, s.max_abs / s.limit_abs);
      }
      v.last = Math.max(v.last, rec.time_unix);
    }
  }
  consoleLine(`[ops] telemetry: ${runs.length} gating runs and ${drifts.length} drift-guard events kept in this browser`);
  for (const [k, v] of Object.entries(per)) {
    consoleLine(`[ops]   ${k}: ${v.runs} runs, ${v.pass} passes, ${v.fail} failures, worst max_abs ${(100 * v.worst).toFixed(1)}% of its limit, last ${iso(v.last)}`);
  }
  for (const d of drifts) {
    consoleLine(`[ops]   drift guard on ${adapterOf(d)}: ${d.subject} at position ${d.position}, KL=${d.kl.toExponential(3)} (bound ${d.bound.toExponential(3)}), top-1 ${d.same_top1}/${d.checks}, ${d.paths.join(', ')} off, ${iso(d.time_unix)}`);
  }
};

// For tests and diagnostics: the worker's commands from the page's console.
window.tinygpt = { call };

boot();
