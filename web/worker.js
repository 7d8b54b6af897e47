// The playground's engine: TinyGPT's Rust crates compiled to wasm32, in a Web Worker so the page never
// freezes. The page sends one command at a time ({id, cmd, args}); "stop" is answered at once and asks a
// running generation to end. Log lines and generated text come back as events while a command runs.
//
// Gate verdicts persist in IndexedDB (a worker has no localStorage): read before the session opens,
// written after every gating run, with the gate's telemetry records beside them.

import init, { open_session } from './pkg/tinygpt_web.js';

let session = null;
let choice = 'auto';
let queue = Promise.resolve();

const post = (msg) => self.postMessage(msg);
const log = (line) => post({ event: 'log', line });

// ---- IndexedDB: one object store of JSON strings --------------------------------------------------
function db() {
  return new Promise((resolve, reject) => {
    const r = indexedDB.open('tinygpt', 1);
    r.onupgradeneeded = () => r.result.createObjectStore('kv');
    r.onsuccess = () => resolve(r.result);
    r.onerror = () => reject(r.error);
  });
}
async function idbGet(key) {
  try {
    const d = await db();
    return await new Promise((resolve) => {
      const q = d.transaction('kv').objectStore('kv').get(key);
      q.onsuccess = () => resolve(q.result ?? null);
      q.onerror = () => resolve(null);
    });
  } catch { return null; }
}
async function idbSet(key, value) {
  try {
    const d = await db();
    await new Promise((resolve) => {
      const t = d.transaction('kv', 'readwrite');
      t.objectStore('kv').put(value, key);
      t.oncomplete = resolve;
      t.onerror = resolve;
    });
  } catch { /* storage unavailable: verdicts are simply not kept */ }
}

// Telemetry records (gating runs, drift-guard events), kept to the last 500 in this browser only.
async function appendHistory(fresh) {
  if (!fresh.length) return;
  const history = JSON.parse((await idbGet('history')) ?? '[]').concat(fresh).slice(-500);
  await idbSet('history', JSON.stringify(history));
}

// After every gating run: the verdicts, and the run's telemetry.
async function persist() {
  await idbSet('verdicts', session.verdicts());
  await appendHistory(JSON.parse(session.take_records()));
}

// The GGUF model the chat runs (named in drift-guard records).
let chatModel = '';

// A drift-guard event, recorded as the CLI records it (`tinygpt gates --history` reads the same shape).
async function recordDrift(d, subject = chatModel) {
  const info = JSON.parse(session.adapter_info());
  await appendHistory([{
    kind: 'drift', time_unix: Math.floor(Date.now() / 1000),
    adapter: info.name ?? session.backend(), driver: `${info.driver ?? ''} ${info.driver_info ?? ''}`.trim(),
    subject, position: d.position, kl: d.kl, bound: d.bound, same_top1: d.same_top1,
    checks: d.checks, paths: d.paths,
  }]);
}

async function fetchBytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

// The bundled model: fetched from the page's own folder, gated end to end, ready to sample.
async function loadBundled() {
  const t0 = performance.now();
  const [config, model] = await Promise.all([
    fetchBytes('models/shakespeare-char/config.json'),
    fetchBytes('models/shakespeare-char/model.safetensors'),
  ]);
  const info = JSON.parse(await session.load_gpt(config, model, log));
  await persist();
  return { ...info, seconds: (performance.now() - t0) / 1000 };
}

async function open(backend, driftCheck) {
  choice = backend;
  await init();
  const verdicts = (await idbGet('verdicts')) ?? '{}';
  session = await open_session(backend, verdicts);
  if (driftCheck != null) session.set_drift_check(driftCheck);
  if (session.backend() !== 'CPU (wasm)') log(`[ops] adapter: ${session.adapter_info()}`);
  const t0 = performance.now();
  const pills = session.backend() === 'CPU (wasm)' ? [] : JSON.parse(await session.gate(false, log));
  await persist();
  return { backend: session.backend(), fallback: session.fallback() ?? null, pills, gateSeconds: (performance.now() - t0) / 1000 };
}

// A file read in slices into one buffer, with progress (a whole multi-hundred-MB read at once can fail).
async function readFile(file) {
  const out = new Uint8Array(file.size);
  const step = 16 << 20;
  for (let off = 0; off < file.size; off += step) {
    const part = new Uint8Array(await file.slice(off, off + step).arrayBuffer());
    out.set(part, off);
    post({ event: 'progress', what: `reading ${file.name}`, done: off + part.length, total: file.size });
  }
  return out;
}

const commands = {
  async init({ backend, driftCheck }) {
    try {
      return await open(backend, driftCheck);
    } catch (e) {
      if (backend === 'cpu') throw e;
      log(`[ops] WebGPU failed (${e.message ?? e}) — running on the CPU (wasm)`);
      const r = await open('cpu', driftCheck);
      r.fallback = `WebGPU failed: ${e.message ?? e}`;
      return r;
    }
  },
  loadBundled,
  async regate() {
    const pills = session.backend() === 'CPU (wasm)' ? [] : JSON.parse(await session.gate(true, log));
    await persist();
    return pills;
  },
  async history() { return JSON.parse((await idbGet('history')) ?? '[]'); },
  async generate({ prompt, n, temperature, topK, seed }) {
    const r = JSON.parse(await session.generate(prompt, n, temperature, topK, 1.0, BigInt(seed),
      (t) => post({ event: 'text', target: 'output', text: t })));
    if (r.drift) await recordDrift(r.drift, 'char-level GPT');
    return r;
  },
  trainStart({ preset, text }) { return JSON.parse(session.train_start(JSON.stringify(preset), text)); },
  async trainSteps({ k }) { return JSON.parse(await session.train_steps(k)); },
  async trainEval({ batches }) { return JSON.parse(await session.train_eval(batches)); },
  async trainCheckpoint() { return await session.train_checkpoint(); },
  async trainUse() { await session.use_trained(log); await persist(); return true; },
  async loadCheckpoint({ file }) {
    const info = JSON.parse(await session.load_checkpoint(await readFile(file), log));
    await persist();
    return info;
  },
  async bundledText() { return await (await fetch('data/shakespeare.txt')).text(); },
  async loadGguf({ file }) {
    const bytes = await readFile(file);
    post({ event: 'progress', what: `loading ${file.name}`, done: 0, total: 0 });
    // The model answers on the f32 path at once; its fast paths are gated in the background, and
    // their verdicts saved (after whatever command runs then) when the gates finish.
    const gated = (json) => {
      post({ event: 'gated', ...JSON.parse(json) });
      queue = queue.then(() => persist()).catch(() => {});
    };
    const info = JSON.parse(await session.load_gguf(bytes, file.name.replace(/\.gguf$/i, ''), log, gated));
    chatModel = info.name;
    return info;
  },
  async chatSend({ message, maxTokens, temperature, seed }) {
    const r = JSON.parse(await session.chat_send(message, maxTokens, temperature, BigInt(seed),
      (t) => post({ event: 'text', target: 'chat', text: t })));
    if (r.drift) await recordDrift(r.drift);
    return r;
  },
  chatReset() { session.chat_reset(); return true; },
  async benchSteps({ n }) { await session.bench_steps(n, log); return true; },
};

async function handle(id, cmd, args) {
  try {
    const result = await commands[cmd](args ?? {});
    post({ id, ok: true, result });
  } catch (e) {
    const message = String(e?.message ?? e);
    // A lost device: the same model on the CPU (wasm), said in the status bar.
    if (/device was lost|device lost/i.test(message) && choice !== 'cpu') {
      post({ event: 'device-lost', message });
      try {
        await open('cpu');
        await loadBundled();
      } catch { /* reported below */ }
    }
    post({ id, ok: false, error: message });
  }
}

self.onmessage = (e) => {
  const { id, cmd, args } = e.data;
  if (cmd === 'stop') {
    session?.stop();
    post({ id, ok: true, result: true });
    return;
  }
  queue = queue.then(() => handle(id, cmd, args));
};
