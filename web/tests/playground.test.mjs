// The playground in real headless Chromium (Debian's, driven by playwright-core): once on WebGPU
// (Chromium's SwiftShader adapter, `?backend=gpu`) and once on the wasm CPU backend (`?backend=cpu`).
// The page is served by `tinygpt serve --web-dir web/dist`, as users get it; native commands of the
// same binary give the texts the page must reproduce.
//
// Environment: TINYGPT_BIN (default target/release/tinygpt), TINYGPT_MODELS_DIR (default .cache/models),
// CHROMIUM (default /usr/bin/chromium).

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, mkdirSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const BIN = process.env.TINYGPT_BIN ?? path.join(ROOT, 'target/release/tinygpt');
const MODELS = process.env.TINYGPT_MODELS_DIR ?? path.join(ROOT, '.cache/models');
const SMOLLM2 = path.join(MODELS, 'SmolLM2-135M-Instruct.Q4_1.gguf');
const GEMMA = path.join(MODELS, 'gemma-3-270m-Q4_K_M.gguf');
const QWEN2 = path.join(ROOT, 'crates/models/tests/data/qwen/qwen2.q8_0.gguf');
const ENV = { ...process.env, TINYGPT_CACHE_DIR: mkdtempSync(path.join(tmpdir(), 'tinygpt-web-cache-')) };
const MINUTE = 60_000;

let server;
let base;
let browser;
const t0 = Date.now();
const mark = (what) => console.log(`# ${((Date.now() - t0) / 1000).toFixed(0)} s: ${what}`);

// The native reference: the CPU backend on the canonical f32 kernels (the page's CPU backend has no
// fast path; its `int-dot` path would leave the f32 text at a near-tie, as any gated path may).
function native(args, input) {
  return execFileSync(BIN, ['--backend', 'cpu', '--f32-only', ...args], { env: ENV, input, encoding: 'utf8', stdio: ['pipe', 'pipe', 'pipe'] });
}

before(async () => {
  assert.ok(existsSync(path.join(ROOT, 'web/dist/pkg/tinygpt_web_bg.wasm')), 'web/dist is built (bash scripts/build-web.sh)');
  assert.ok(existsSync(SMOLLM2), `${SMOLLM2} is present (bash scripts/fetch-models.sh)`);
  mkdirSync(path.join(ROOT, 'docs/img'), { recursive: true });
  server = spawn(BIN, ['--backend', 'cpu', 'serve', '--port', '0', '--web-dir', path.join(ROOT, 'web/dist')], { env: ENV });
  base = await new Promise((resolve, reject) => {
    let buf = '';
    let addr;
    const timer = setTimeout(() => reject(new Error(`the server did not start: ${buf}`)), 2 * MINUTE);
    server.stderr.on('data', (d) => {
      buf += d;
      // The whole address: a chunk of stderr may end inside it.
      addr ??= buf.match(/listening on (http:\/\/\S+)\s/)?.[1];
      if (addr && buf.includes('ready:')) {
        clearTimeout(timer);
        resolve(addr);
      }
    });
    server.on('exit', (c) => reject(new Error(`the server exited (${c}): ${buf}`)));
  });
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    args: ['--headless=new', '--no-sandbox', '--disable-gpu-sandbox', '--enable-unsafe-webgpu',
      '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic'],
  });
});

after(async () => {
  await browser?.close();
  server?.kill();
});

async function openPage(query) {
  const context = await browser.newContext({ acceptDownloads: true, viewport: { width: 1400, height: 1000 } });
  const page = await context.newPage();
  const consoleLines = [];
  page.on('console', (m) => consoleLines.push(m.text()));
  page.on('pageerror', (e) => consoleLines.push(`pageerror: ${e.message}`));
  await page.goto(`${base}/${query}`);
  await page.waitForFunction(() => /ready to generate|failed|did not load|cannot/.test(document.getElementById('status').textContent), null, { timeout: 10 * MINUTE });
  const status = await page.textContent('#status');
  mark(`${query}: ${status}`);
  assert.match(status, /^inference warmed up in [\d.]+s · .* — ready to generate\.$/, `${status}\n${consoleLines.join('\n')}`);
  return { page, consoleLines, context };
}

async function sample(page, { prompt, n, seed }) {
  await page.fill('#prompt', prompt);
  await page.fill('#length', String(n));
  await page.fill('#temperature', '0.8');
  await page.fill('#top-k', '200');
  await page.fill('#seed', String(seed));
  await page.click('#generate');
  await page.waitForFunction(() => document.getElementById('gen-stats').textContent.includes('tokens/s'), null, { timeout: 10 * MINUTE });
  mark(`sampled ${n}: ${await page.textContent('#gen-stats')}`);
  return await page.textContent('#output');
}

async function trainTiny(page, context, iters) {
  await page.selectOption('#train-preset', 'tiny');
  await page.fill('#train-iters', String(iters));
  await page.click('#train-start');
  await page.waitForFunction(() => /^(done|stopped)$/m.test(document.getElementById('train-log').textContent), null, { timeout: 15 * MINUTE });
  const log = await page.textContent('#train-log');
  mark(`trained ${iters} steps: ${log.match(/^iter \d+: loss .*$/gm)?.pop()}`);
  const losses = [...log.matchAll(/^iter (\d+): loss (\d+\.\d{4})/gm)].map((m) => [Number(m[1]), Number(m[2])]);
  assert.ok(losses.length >= 2, log);
  const [first, last] = [losses[0], losses[losses.length - 1]];
  assert.equal(last[0], iters, log);
  assert.ok(last[1] < first[1], `the loss fell over ${iters} steps: ${log}`);
  assert.match(log, /iter \d+: val loss \d+\.\d{4}/);
  // The checkpoint downloads and loads natively.
  const [download] = await Promise.all([page.waitForEvent('download'), page.click('#download-checkpoint')]);
  const dir = mkdtempSync(path.join(tmpdir(), 'tinygpt-web-ckpt-'));
  const zip = path.join(dir, 'checkpoint.zip');
  await download.saveAs(zip);
  execFileSync('python3', ['-c', 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])', zip, dir]);
  const out = native(['generate', '--model', path.join(dir, 'checkpoint'), '-n', '40', '--seed', '3']);
  assert.ok(out.length >= 40, out);
  return losses;
}

test('WebGPU (SwiftShader): gates, pills, sampling, training, checkpoint', { timeout: 40 * MINUTE }, async () => {
  // The drift guard checks one token in 8 here (128 by default), so that a short sample meets it.
  const { page, consoleLines, context } = await openPage('?backend=gpu&drift-check=8');
  assert.ok(consoleLines.some((l) => l.includes('[ops] drift guard: every 8 tokens on fast paths (?drift-check=8)')), consoleLines.join('\n'));
  // Gates ran, with the precision spec's log line, and every pill shows its verdict.
  const f16 = consoleLines.find((l) => l.startsWith('[ops] f16-storage gate:'));
  assert.match(f16 ?? '', /^\[ops\] f16-storage gate: mean\|ref\|=[\d.]+, max_abs=\S+ \(limit \S+\), mean_rel=[\d.]+% \(limit [\d.]+%\), max_rel=[\d.]+% — PASS — f16 path active$/, consoleLines.join('\n'));
  const pills = await page.$$eval('#pills .pill', (els) => els.map((e) => ({ path: e.dataset.path, active: e.dataset.active, title: e.title, text: e.textContent })));
  const pill = (p) => pills.find((x) => x.path === p);
  assert.equal(pill('f16-storage').active, 'true');
  assert.equal(pill('f16-storage').text, '+f16 storage');
  assert.equal(pill('coop-matrix').active, 'false');
  assert.match(pill('coop-matrix').title, /lacks/);
  assert.equal(pill('webnn').active, 'false');
  assert.ok(pill('webnn').title.length > 0);
  assert.match(await page.textContent('#backend'), /WebGPU/);
  assert.ok(consoleLines.some((l) => l.startsWith('[ops] token gate:')), consoleLines.join('\n'));
  // The telemetry this browser keeps: the gating runs just recorded, per path, with the worst figure.
  await page.click('#history');
  await page.waitForFunction(() => /\[ops\] telemetry: [1-9]\d* gating runs and \d+ drift-guard events/.test(document.getElementById('console').textContent), null, { timeout: MINUTE });
  const telemetry = await page.textContent('#console');
  assert.match(telemetry, /\[ops\] {3}.+ · f16-storage: [1-9]\d* runs, [1-9]\d* passes, 0 failures, worst max_abs \d+\.\d% of its limit, last \d{4}-/, telemetry);
  // The same text as the native CPU backend for the same seed, prompt and settings, while the drift
  // guard (the same library as natively, its f32 shadow in line in the worker) took 3 of the 30 steps
  // again on the f32 path and found them within its bound.
  const want = native(['generate', '--prompt', 'ROMEO:', '-n', '30', '--seed', '7']).replace(/\n$/, '');
  assert.equal(await sample(page, { prompt: 'ROMEO:', n: 30, seed: 7 }), want);
  assert.match(await page.textContent('#gen-stats'), /^30 characters in [\d.]+ s \([\d.]+ tokens\/s\) · drift guard: 3 checks on the f32 path so far$/);
  assert.doesNotMatch(await page.textContent('#console'), /drift guard: position/);
  // A GGUF model is ready at once on the f32 path while its fast paths are gated in the background;
  // the first reply (greedy) equals `tinygpt chat`'s, and once the gates pass the chat moves to them.
  await page.setInputFiles('#gguf-file', QWEN2);
  await page.waitForFunction(() => !document.getElementById('chat-input').disabled || /cannot load/.test(document.getElementById('status').textContent), null, { timeout: 5 * MINUTE });
  assert.doesNotMatch(await page.textContent('#status'), /cannot load/, await page.textContent('#console'));
  assert.match(await page.textContent('#gguf-info'), /qwen2.*f32 path, fast paths gating…/);
  assert.match(await page.textContent('#status'), /ready to chat \(on the f32 path while the fast paths are gated in the background\)/);
  for (const message of ['Hello', 'Hi']) {
    if (message === 'Hi') {
      await page.waitForFunction(() => /\[ops\] fast paths gated in [\d.]+ s: \+/.test(document.getElementById('console').textContent), null, { timeout: 10 * MINUTE });
    }
    await page.fill('#chat-temperature', '0');
    await page.fill('#chat-max-tokens', '8');
    await page.fill('#chat-input', message);
    await page.click('#chat-send');
    // The reply is done when the send button is back (the status line may have moved on to gating).
    await page.waitForFunction((m) => !document.getElementById('chat-send').disabled && document.getElementById('chat-output').textContent.includes(`> ${m}\n`), message, { timeout: 5 * MINUTE });
  }
  const qwenLog = await page.textContent('#console');
  mark(`qwen2 chat: ${qwenLog.split('\n').filter((l) => /fast paths gated|the chat moved/.test(l)).join(' | ')}`);
  const qwenReply = (await page.textContent('#chat-output')).split('> Hello\n')[1].split('\n> Hi')[0].replace(/\n$/, '');
  const qwenNative = native(['chat', QWEN2, '-n', '8', '--temperature', '0'], 'Hello\n');
  assert.equal(qwenReply, qwenNative.replace(/\n$/, ''), `page: ${JSON.stringify(await page.textContent('#chat-output'))} · ${await page.textContent('#status')}\n${qwenLog.slice(-2000)}\n${consoleLines.slice(-20).join('\n')}`);
  assert.match(qwenLog, /\[ops\] the chat moved to [a-z0-9-]+( \+ [a-z0-9-]+)* at position \d+/, qwenLog);
  assert.doesNotMatch(await page.textContent('#gguf-info'), /gating…/);
  await trainTiny(page, context, 30);
  await page.screenshot({ path: path.join(ROOT, 'docs/img/playground.png'), fullPage: true });
  await context.close();
});

test('CPU (wasm): sampling, training, SmolLM2 and Gemma 3 from a file, a bad file', { timeout: 40 * MINUTE }, async () => {
  const { page, context } = await openPage('?backend=cpu');
  assert.equal(await page.textContent('#backend'), 'CPU (wasm)');
  assert.match(await page.textContent('#status'), /CPU \(wasm\)/);
  const pills = await page.$$eval('#pills .pill', (els) => els.map((e) => e.dataset.path));
  assert.deepEqual(pills, ['webnn'], 'no GPU paths on the CPU backend');
  const want = native(['generate', '--prompt', 'JULIET:', '-n', '200', '--seed', '11']).replace(/\n$/, '');
  assert.equal(await sample(page, { prompt: 'JULIET:', n: 200, seed: 11 }), want);
  await trainTiny(page, context, 30);
  // SmolLM2 from the file input: its greedy 32-token reply equals `tinygpt chat`'s.
  await page.setInputFiles('#gguf-file', SMOLLM2);
  await page.waitForFunction(() => !document.getElementById('chat-input').disabled, null, { timeout: 10 * MINUTE });
  assert.match(await page.textContent('#gguf-info'), /SmolLM2-135M-Instruct.*llama/);
  const question = 'Tell me about the Moon.';
  await page.fill('#chat-temperature', '0');
  await page.fill('#chat-max-tokens', '32');
  await page.fill('#chat-input', question);
  await page.click('#chat-send');
  await page.waitForFunction(() => /tokens in/.test(document.getElementById('status').textContent), null, { timeout: 10 * MINUTE });
  mark(`chat: ${await page.textContent('#status')}`);
  const transcript = await page.textContent('#chat-output');
  const reply = transcript.split(`> ${question}\n`)[1].replace(/\n$/, '');
  const nativeOut = native(['chat', SMOLLM2, '-n', '32', '--temperature', '0'], `${question}\n`);
  assert.equal(reply, nativeOut.replace(/\n$/, ''), `page: ${JSON.stringify(reply)}`);
  // Gemma-3-270M runs too (a 262,144-token vocabulary; read in slices): its greedy reply equals
  // `tinygpt chat`'s.
  await page.setInputFiles('#gguf-file', GEMMA);
  await page.waitForFunction(() => /gemma3/.test(document.getElementById('gguf-info').textContent), null, { timeout: 10 * MINUTE });
  await page.fill('#chat-max-tokens', '8');
  await page.fill('#chat-input', 'Hi');
  await page.click('#chat-send');
  await page.waitForFunction(() => /tokens in/.test(document.getElementById('status').textContent), null, { timeout: 10 * MINUTE });
  mark(`gemma chat: ${await page.textContent('#status')}`);
  const gemmaReply = (await page.textContent('#chat-output')).split('> Hi\n')[1].replace(/\n$/, '');
  const gemmaNative = native(['chat', GEMMA, '-n', '8', '--temperature', '0'], 'Hi\n');
  assert.equal(gemmaReply, gemmaNative.replace(/\n$/, ''), `page: ${JSON.stringify(gemmaReply)}`);
  // Bad input: a file that is not GGUF gets one clear message, and the page keeps working.
  const bad = path.join(mkdtempSync(path.join(tmpdir(), 'tinygpt-web-bad-')), 'notes.gguf');
  execFileSync('sh', ['-c', `echo 'not a model' > ${bad}`]);
  await page.setInputFiles('#gguf-file', bad);
  await page.waitForFunction(() => /cannot load notes\.gguf/.test(document.getElementById('status').textContent), null, { timeout: MINUTE });
  assert.match(await page.textContent('#status'), /not a GGUF model/);
  assert.equal(await sample(page, { prompt: 'JULIET:', n: 200, seed: 11 }), want, 'the page still samples');
  await context.close();
});

test('a browser without WebGPU falls back to the CPU (wasm)', { timeout: 10 * MINUTE }, async () => {
  const context = await browser.newContext();
  // As a browser without WebGPU: navigator.gpu removed before the page's scripts run.
  await context.addInitScript(() => { delete Navigator.prototype.gpu; });
  const page = await context.newPage();
  await page.goto(`${base}/`);
  await page.waitForFunction(() => /ready to generate|failed/.test(document.getElementById('status').textContent), null, { timeout: 5 * MINUTE });
  assert.equal(await page.textContent('#backend'), 'CPU (wasm)');
  assert.match(await page.textContent('#console'), /no WebGPU \(navigator\.gpu\)/);
  await context.close();
});
