//! `tinygpt serve` end to end: the real binary on a loopback port, driven by a real HTTP client
//! (reqwest). SmolLM2-135M (from scripts/fetch-models.sh) on the CPU backend, and the bundled
//! Shakespeare model for plain completions.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::smollm2;

/// A running server; killed when dropped.
struct Server {
    child: Child,
    base: String,
    /// stderr lines after startup.
    log: mpsc::Receiver<String>,
    /// Whether /health answered 503 before the model was ready.
    saw_loading: bool,
    /// The line that said the server is ready.
    ready: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
    c.env(
        "TINYGPT_CACHE_DIR",
        std::env::temp_dir().join("tinygpt-serve-test-cache"),
    );
    c
}

/// Starts `tinygpt --backend cpu serve ARGS --port 0` and waits until it is ready.
fn start(args: &[&str]) -> Server {
    start_on("cpu", args)
}

/// [`start`] on `backend` (cpu or gpu).
fn start_on(backend: &str, args: &[&str]) -> Server {
    start_with(bin(), backend, args)
}

/// [`start_on`] from the command `cmd` (its environment set).
fn start_with(mut cmd: Command, backend: &str, args: &[&str]) -> Server {
    let mut child = cmd
        .args(["--backend", backend, "serve", "--port", "0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[server] {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut base = None;
    let mut saw_loading = false;
    let ready = loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the server starts within two minutes");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().to_string();
            // Right after binding, the model is still loading.
            if let Some((status, body)) = get_now(&format!("http://{addr}/health")) {
                saw_loading = status == 503 && body.contains("loading");
            }
            base = Some(format!("http://{addr}"));
        }
        if line.starts_with("ready:") {
            break line;
        }
    };
    Server {
        child,
        base: base.expect("the server printed its address"),
        log: rx,
        saw_loading,
        ready,
    }
}

/// One GET, blocking: (status, body).
fn get_now(url: &str) -> Option<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async {
        let r = reqwest::get(url).await.ok()?;
        let s = r.status().as_u16();
        Some((s, r.text().await.ok()?))
    })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn post(base: &str, path: &str, body: Value, key: Option<&str>) -> (u16, String) {
    let mut r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("request sent");
    let s = r.status().as_u16();
    (s, r.text().await.expect("body"))
}

/// The text and chunks of an SSE body.
fn sse(body: &str) -> (String, Vec<Value>) {
    let mut text = String::new();
    let mut chunks = Vec::new();
    for line in body.lines() {
        let Some(d) = line.strip_prefix("data: ") else {
            continue;
        };
        if d == "[DONE]" {
            chunks.push(json!("[DONE]"));
            continue;
        }
        let v: Value = serde_json::from_str(d).expect("chunk is JSON");
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            text.push_str(c["text"].as_str().unwrap_or(""));
        }
        chunks.push(v);
    }
    (text, chunks)
}

/// `tinygpt run`'s greedy continuation of `prompt` (JSON output): (text, generated ids, prompt ids).
fn run_greedy(prompt: &str, n: usize) -> (String, usize, usize) {
    run_greedy_on("cpu", prompt, n)
}

/// [`run_greedy`] on `backend`.
fn run_greedy_on(backend: &str, prompt: &str, n: usize) -> (String, usize, usize) {
    let mut cmd = bin();
    cmd.args(["--backend", backend]);
    run_greedy_with(cmd, &smollm2(), prompt, n)
}

/// [`run_greedy`] of `model` from the command `cmd` (its environment and global flags set).
fn run_greedy_with(
    cmd: Command,
    model: &std::path::Path,
    prompt: &str,
    n: usize,
) -> (String, usize, usize) {
    run_sampled_with(cmd, model, prompt, n, &["--temperature", "0"])
}

/// [`run_greedy_with`] with the sampling flags `sampling` instead of greedy.
fn run_sampled_with(
    mut cmd: Command,
    model: &std::path::Path,
    prompt: &str,
    n: usize,
    sampling: &[&str],
) -> (String, usize, usize) {
    let out = cmd
        .arg("run")
        .arg(model)
        .args(["-p", prompt, "-n", &n.to_string(), "--format", "json"])
        .args(sampling)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    (
        v["text"].as_str().unwrap().to_string(),
        v["generated_ids"].as_array().unwrap().len(),
        v["prompt_ids"].as_array().unwrap().len(),
    )
}

/// The chat prompt the server renders for one user message (SmolLM2's template).
fn chat_prompt(user: &str) -> String {
    let file = tinygpt_formats::GgufFile::open(smollm2()).unwrap();
    let tok = tinygpt_models::tokenizer::Tokenizer::from_gguf(file.metadata()).unwrap();
    let t = tinygpt_models::chat_template::ChatTemplate::new(tok.chat_template().unwrap()).unwrap();
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    t.render(
        &[("user", user)],
        true,
        &text(tok.bos_id()),
        &text(tok.eos_id()),
    )
    .unwrap()
}

#[test]
fn chat_and_completions_match_tinygpt_run_with_exact_usage() {
    let s = start(&[smollm2().to_str().unwrap(), "--parallel", "4"]);
    assert!(s.saw_loading, "/health answers 503 while the model loads");
    let rt = rt();
    let question = "What is the capital of France?";
    let (want, n_gen, n_prompt) = run_greedy(&chat_prompt(question), 24);
    // Streaming chat, with usage.
    let body = json!({"model": "SmolLM2-135M-Instruct", "stream": true, "max_tokens": 24,
        "temperature": 0, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": question}]});
    let (status, raw) = rt.block_on(post(&s.base, "/v1/chat/completions", body.clone(), None));
    assert_eq!(status, 200, "{raw}");
    let (text, chunks) = sse(&raw);
    assert_eq!(text, want, "streamed chat = tinygpt run's greedy text");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks.last().unwrap(), &json!("[DONE]"));
    let usage = &chunks[chunks.len() - 2]["usage"];
    assert_eq!(usage["prompt_tokens"], n_prompt);
    assert_eq!(usage["completion_tokens"], n_gen);
    assert_eq!(usage["total_tokens"], n_prompt + n_gen);
    let finish = &chunks[chunks.len() - 3]["choices"][0]["finish_reason"];
    assert!(finish == "stop" || finish == "length", "{finish}");
    // The same request whole.
    let mut whole = body;
    whole["stream"] = json!(false);
    let (status, raw) = rt.block_on(post(&s.base, "/v1/chat/completions", whole, None));
    assert_eq!(status, 200, "{raw}");
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], want);
    assert_eq!(v["usage"]["completion_tokens"], n_gen);
    // Text completion, whole, with a stop string.
    let (want, _, n_prompt) = run_greedy("The capital of France is", 16);
    let (status, raw) = rt.block_on(post(
        &s.base,
        "/v1/completions",
        json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}),
        None,
    ));
    assert_eq!(status, 200, "{raw}");
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(v["usage"]["prompt_tokens"], n_prompt);
    let stop_at = want.find('.').expect("the continuation has a period");
    let (_, raw) = rt.block_on(post(
        &s.base,
        "/v1/completions",
        json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stop": ["."]}),
        None,
    ));
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(
        v["choices"][0]["text"],
        &want[..stop_at],
        "text ends before the stop string"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Models, tokenize and detokenize.
    let models: Value = rt.block_on(async {
        reqwest::get(format!("{}/v1/models", s.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct");
    let (_, raw) = rt.block_on(post(
        &s.base,
        "/tokenize",
        json!({"content": "Hello world"}),
        None,
    ));
    let toks: Value = serde_json::from_str(&raw).unwrap();
    let (_, raw) = rt.block_on(post(
        &s.base,
        "/detokenize",
        json!({"tokens": toks["tokens"]}),
        None,
    ));
    assert_eq!(
        serde_json::from_str::<Value>(&raw).unwrap()["content"],
        "Hello world"
    );
    // Metrics count what was served.
    let m = rt.block_on(async {
        reqwest::get(format!("{}/metrics", s.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert!(
        m.contains("tinygpt_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2"),
        "{m}"
    );
    assert!(m.contains("tinygpt_completion_tokens_total"), "{m}");
}

/// On the GPU (the software adapter here) requests decoded together get their tokens picked on the
/// device, greedy or sampled (only the ids read back): the same texts as `tinygpt --backend gpu run`
/// gives alone with the same settings and seed.
#[test]
fn requests_decoded_together_on_the_gpu_match_tinygpt_run() {
    if tinygpt_kernels::testing::skip_gpu() {
        return;
    }
    let prompts = ["The capital of France is", "Once upon a time"];
    let mut want: Vec<String> = prompts
        .iter()
        .map(|p| run_greedy_on("gpu", p, 8).0)
        .collect();
    // A sampled request beside them: run with the same settings and seed.
    let sampled = [
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--seed",
        "11",
    ];
    let mut gpu = bin();
    gpu.args(["--backend", "gpu"]);
    want.push(run_sampled_with(gpu, &smollm2(), "Once upon a time", 12, &sampled).0);
    let s = start_on("gpu", &[smollm2().to_str().unwrap(), "--parallel", "3"]);
    let rt = rt();
    let got: Vec<String> = rt.block_on(async {
        let mut bodies: Vec<Value> = prompts
            .iter()
            .map(|p| json!({"prompt": p, "max_tokens": 8, "temperature": 0}))
            .collect();
        bodies.push(
            json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9,
                           "top_k": 40, "top_p": 0.95, "seed": 11}),
        );
        let reqs = bodies
            .into_iter()
            .map(|b| post(&s.base, "/v1/completions", b, None));
        futures_util::future::join_all(reqs)
            .await
            .into_iter()
            .map(|(status, raw)| {
                assert_eq!(status, 200, "{raw}");
                let v: Value = serde_json::from_str(&raw).unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            })
            .collect()
    });
    assert_eq!(got, want);
}

/// On the GPU the server records a step before it has read the last one's picks whenever the batch
/// cannot change in between. Requests that end early (a stop string, a short limit) beside a long one,
/// and a request that joins while the long one runs, leave every text as it is when its request runs
/// alone on the same server.
#[test]
fn requests_ending_and_joining_beside_a_long_one_keep_their_texts_on_the_gpu() {
    if tinygpt_kernels::testing::skip_gpu() {
        return;
    }
    let s = start_on("gpu", &[smollm2().to_str().unwrap(), "--parallel", "3"]);
    let rt = rt();
    let long = json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.8,
                      "top_k": 40, "seed": 5});
    let short = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
    let stopped = json!({"prompt": "Here is a list of fruits:", "max_tokens": 30,
                         "temperature": 0, "stop": [","]});
    let text = |(status, raw): (u16, String)| -> String {
        assert_eq!(status, 200, "{raw}");
        let v: Value = serde_json::from_str(&raw).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let alone: Vec<String> = [&long, &short, &stopped]
        .iter()
        .map(|b| text(rt.block_on(post(&s.base, "/v1/completions", (*b).clone(), None))))
        .collect();
    let together: Vec<String> = rt.block_on(async {
        let long_req = post(&s.base, "/v1/completions", long.clone(), None);
        let others = async {
            let first = futures_util::future::join_all([
                post(&s.base, "/v1/completions", short.clone(), None),
                post(&s.base, "/v1/completions", stopped.clone(), None),
            ])
            .await;
            // A request joining while the long one still runs.
            let late = post(&s.base, "/v1/completions", short.clone(), None).await;
            (first, late)
        };
        let (l, (first, late)) = futures_util::future::join(long_req, others).await;
        let mut out = vec![text(l)];
        out.extend(first.into_iter().map(text));
        out.push(text(late));
        out
    });
    assert_eq!(&together[..3], &alone[..], "texts beside others");
    assert_eq!(together[3], alone[1], "a request joining a running batch");
    assert!(!alone[2].contains(','), "{:?}", alone[2]);
}

/// On an adapter without stored gate verdicts the server is ready at once on the f32 path, gates the
/// fast paths in the background, and moves to them between two requests (never inside one): the texts
/// before and after equal the f32 path's, and /metrics then lists the fast path. On the fast path the
/// drift guard (here every 4 tokens) checks the request's steps against the f32 path and lets it go
/// on: /metrics counts the checks and no event.
#[test]
fn a_server_on_an_ungated_adapter_serves_at_once_and_moves_to_its_fast_paths_between_requests() {
    if tinygpt_kernels::testing::skip_gpu() {
        return;
    }
    let cache = std::env::temp_dir().join(format!("tinygpt-serve-gating-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/qwen/qwen2.q8_0.gguf");
    let with_cache = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
        cmd.env("TINYGPT_CACHE_DIR", &cache);
        cmd
    };
    let mut f32_only = with_cache();
    f32_only.args(["--backend", "gpu", "--f32-only"]);
    let (f32_text, _, _) = run_greedy_with(f32_only, &model, "Hello", 12);
    let s = start_with(
        with_cache(),
        "gpu",
        &[
            model.to_str().unwrap(),
            "--parallel",
            "2",
            "--drift-check",
            "4",
        ],
    );
    assert!(
        s.ready
            .contains("f32 path · gating the fast paths in the background"),
        "{}",
        s.ready
    );
    let rt = rt();
    let complete = || {
        rt.block_on(post(
            &s.base,
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 12, "temperature": 0}),
            None,
        ))
    };
    let text = |raw: &str| {
        let v: Value = serde_json::from_str(raw).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let (status, raw) = complete();
    assert_eq!(status, 200, "{raw}");
    assert_eq!(text(&raw), f32_text);
    // The gates finish in the background; the model moves when no request runs.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut seen = Vec::new();
    loop {
        let line = s
            .log
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no move to the fast paths in:\n{}", seen.join("\n")));
        let moved = line.contains("fast paths gated in") && line.contains("between two requests");
        seen.push(line);
        if moved {
            break;
        }
    }
    let (status, raw) = complete();
    assert_eq!(status, 200, "{raw}");
    assert_eq!(text(&raw), f32_text);
    // Checks every 4 positions of the second request (the first ran on the f32 path, which the guard
    // does not watch): a check counts once the shadow's verdict is taken, which the server does
    // between steps and, once the request is done, while it waits for the next.
    let count_in = |m: &str, name: &str| -> i64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {m}"))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let (status, m) = get_now(&format!("{}/metrics", s.base)).expect("metrics");
        assert_eq!(status, 200);
        if count_in(&m, "tinygpt_drift_checks ") >= 1 || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        m.contains("tinygpt_fast_path_active{path=\"q8 matmul\"} 1"),
        "{m}"
    );
    let count = |name: &str| count_in(&m, name);
    assert!(count("tinygpt_drift_checks ") >= 1, "{m}");
    assert_eq!(count("tinygpt_drift_events "), 0, "{m}");
    // What the guard cost: the engine's checks (their cache reads inside them) and the shadow's steps.
    let secs = |part: &str| -> f64 {
        m.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("tinygpt_drift_guard_seconds{{part=\"{part}\"}}"))?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no drift_guard_seconds for {part} in {m}"))
    };
    let (engine, reads, shadow) = (secs("engine"), secs("cache_reads"), secs("shadow"));
    assert!(engine > 0.0 && reads > 0.0 && shadow > 0.0, "{m}");
    assert!(reads <= engine, "{m}");
    drop(s);
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn every_bad_request_gets_one_clear_error_in_openai_format() {
    let s = start(&[
        smollm2().to_str().unwrap(),
        "--api-key",
        "sekrit",
        "--max-body",
        "100000",
    ]);
    let rt = rt();
    let key = Some("sekrit");
    let chat = |body: Value, key: Option<&str>| {
        rt.block_on(post(&s.base, "/v1/chat/completions", body, key))
    };
    let msg = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(Value, Option<&str>, u16, &str)> = vec![
        (json!({"messages": msg}), None, 401, "invalid_api_key"),
        (
            json!({"messages": msg}),
            Some("wrong"),
            401,
            "invalid_api_key",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            key,
            400,
            "messages[0].content",
        ),
        (
            json!({"messages": msg, "temperature": "hot"}),
            key,
            400,
            "temperature",
        ),
        (
            json!({"messages": msg, "temperature": 3}),
            key,
            400,
            "temperature",
        ),
        (json!({"messages": msg, "n": 2}), key, 400, "\"n\""),
        (
            json!({"messages": msg, "logprobs": true}),
            key,
            400,
            "logprobs",
        ),
        (
            json!({"messages": msg, "max_tokens": 0}),
            key,
            400,
            "max_tokens",
        ),
        (
            json!({"messages": msg, "model": "gpt-4"}),
            key,
            404,
            "model_not_found",
        ),
        (json!({"msgs": msg}), key, 400, "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            key,
            400,
            "messages[0].role",
        ),
        (
            json!({"messages": msg, "stop": ["a", "b", "c", "d", "e"]}),
            key,
            400,
            "stop",
        ),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(5000)}]}),
            key,
            400,
            "context_length_exceeded",
        ),
    ];
    for (body, k, status, needle) in cases {
        let (got, raw) = chat(body.clone(), k);
        assert_eq!(got, status, "{body}: {raw}");
        let v: Value =
            serde_json::from_str(&raw).unwrap_or_else(|_| panic!("error body is JSON: {raw}"));
        assert!(v["error"]["message"].is_string(), "{raw}");
        assert!(raw.contains(needle), "{body}: {raw} should name {needle}");
    }
    // Not JSON, too large, unknown route: still OpenAI's format.
    let raw_post = |path: &str, body: Vec<u8>| {
        rt.block_on(async {
            let r = reqwest::Client::new()
                .post(format!("{}{path}", s.base))
                .bearer_auth("sekrit")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    let (st, raw) = raw_post("/v1/chat/completions", b"{not json".to_vec());
    assert!(st == 400 && raw.contains("not valid JSON"), "{st} {raw}");
    let (st, raw) = raw_post("/v1/completions", vec![b'x'; 200_000]);
    assert!(st == 413 && raw.contains("request_too_large"), "{st} {raw}");
    let (st, raw) = raw_post("/v1/nothing", b"{}".to_vec());
    assert!(st == 404 && raw.contains("unknown_url"), "{st} {raw}");
    // The server kept serving through all of it.
    let (st, raw) = chat(json!({"messages": msg, "max_tokens": 2}), key);
    assert_eq!(st, 200, "{raw}");
}

/// 200 concurrent streaming requests, each checked against the text its (prompt, seed) gives alone.
#[test]
fn two_hundred_concurrent_streams_each_get_their_own_text() {
    let s = start(&[
        smollm2().to_str().unwrap(),
        "--parallel",
        "16",
        "--queue",
        "256",
    ]);
    let rt = rt();
    const PROMPTS: [&str; 4] = [
        "Once upon a time",
        "The sea is",
        "My favourite food is",
        "In 1492,",
    ];
    let body = |i: usize| {
        json!({"prompt": PROMPTS[i % PROMPTS.len()], "max_tokens": 12, "seed": (i % 8) as i64,
               "temperature": 1.0, "top_k": 40, "top_p": 0.95, "stream": true})
    };
    // Alone: one request at a time.
    let mut alone = Vec::new();
    for i in 0..8 {
        let (st, raw) = rt.block_on(post(&s.base, "/v1/completions", body(i), None));
        assert_eq!(st, 200, "{raw}");
        alone.push(sse(&raw).0);
    }
    let t = Instant::now();
    let all = rt.block_on(async {
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let base = s.base.clone();
                tokio::spawn(
                    async move { (i, post(&base, "/v1/completions", body(i), None).await) },
                )
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("task"));
        }
        out
    });
    assert!(
        t.elapsed() < Duration::from_secs(300),
        "the load test is bounded in time"
    );
    assert_eq!(all.len(), 200);
    for (i, (st, raw)) in all {
        assert_eq!(st, 200, "request {i}: {raw}");
        let (text, chunks) = sse(&raw);
        assert_eq!(
            chunks.last().unwrap(),
            &json!("[DONE]"),
            "request {i} finished"
        );
        assert_eq!(text, alone[i % 8], "request {i} got its own text, as alone");
    }
}

#[test]
fn a_client_that_leaves_frees_its_slot_and_a_full_queue_says_429() {
    let s = start(&[
        smollm2().to_str().unwrap(),
        "--parallel",
        "1",
        "--queue",
        "1",
    ]);
    let rt = rt();
    let long = json!({"prompt": "Tell me a story.", "max_tokens": 400, "stream": true,
                      "ignore_eos": true});
    rt.block_on(async {
        // Hold the only slot, then fill the queue; the third request is refused.
        let client = reqwest::Client::new();
        let mut first = client
            .post(format!("{}/v1/completions", s.base))
            .json(&long)
            .send()
            .await
            .unwrap();
        let _ = first.chunk().await.unwrap();
        let queued = tokio::spawn({
            let (base, long) = (s.base.clone(), long.clone());
            async move { post(&base, "/v1/completions", long, None).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (st, raw) = post(&s.base, "/v1/completions", long.clone(), None).await;
        assert_eq!(st, 429, "{raw}");
        assert!(raw.contains("queue_full"), "{raw}");
        // The first client leaves: its slot goes to the queued request, which completes.
        drop(first);
        let (st, raw) = tokio::time::timeout(Duration::from_secs(120), queued)
            .await
            .expect("the queued request gets the slot")
            .unwrap();
        assert_eq!(st, 200);
        assert!(raw.contains("[DONE]"));
    });
}

#[test]
fn the_bundled_model_completes_text_as_tinygpt_generate_does_and_stops_gracefully() {
    let mut s = start(&[]);
    let rt = rt();
    let out = bin()
        .args([
            "--backend",
            "cpu",
            "generate",
            "--prompt",
            "ROMEO:",
            "-n",
            "60",
            "--seed",
            "7",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let want = String::from_utf8(out.stdout).unwrap();
    let want = want
        .trim_end_matches('\n')
        .strip_prefix("ROMEO:")
        .unwrap()
        .to_string();
    let (st, raw) = rt.block_on(post(
        &s.base,
        "/v1/completions",
        json!({"prompt": "ROMEO:", "max_tokens": 60, "seed": 7, "temperature": 0.8, "top_k": 200, "top_p": 1.0}),
        None,
    ));
    assert_eq!(st, 200, "{raw}");
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(v["model"], "shakespeare-char");
    let (st, raw) = rt.block_on(post(
        &s.base,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        None,
    ));
    assert!(st == 400 && raw.contains("no chat template"), "{st} {raw}");
    // SIGTERM during a stream: the stream ends with an error chunk, the server exits.
    let body = rt.block_on(async {
        let mut r = reqwest::Client::new()
            .post(format!("{}/v1/completions", s.base))
            .json(&json!({"prompt": "ROMEO:", "max_tokens": 100000, "stream": true}))
            .send()
            .await
            .unwrap();
        let mut body = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
        let pid = s.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        while let Ok(Some(c)) = r.chunk().await {
            body.push_str(&String::from_utf8_lossy(&c));
        }
        body
    });
    assert!(body.contains("shutting down"), "{body}");
    let t = Instant::now();
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exits cleanly");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the server stops within 20 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let lines: Vec<String> = s.log.try_iter().collect();
    assert!(lines.iter().any(|l| l.contains("stopped")), "{lines:?}");
}

/// The bundled char-level model served on a GPU on its gated fast paths: the drift guard checks every
/// N tokens of each request (counted in /metrics) without changing a token: each request's text is
/// `tinygpt generate`'s on the same adapter with the same seed.
#[test]
fn the_bundled_model_on_a_gpu_is_watched_by_the_drift_guard() {
    let generate = |seed: &str| {
        let out = bin()
            .args(["--backend", "gpu", "--drift-check", "0", "generate"])
            .args(["--prompt", "ROMEO:", "-n", "70", "--seed", seed])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        text.trim_end_matches('\n')
            .strip_prefix("ROMEO:")
            .unwrap()
            .to_string()
    };
    let want = [generate("5"), generate("6")];
    let s = start_on("gpu", &["--parallel", "2", "--drift-check", "16"]);
    assert!(!s.ready.contains("f32 path"), "{}", s.ready);
    let rt = rt();
    let got = rt.block_on(async {
        let one = |seed: u64| {
            post(
                &s.base,
                "/v1/completions",
                json!({"prompt": "ROMEO:", "max_tokens": 70, "seed": seed, "temperature": 0.8,
                       "top_k": 200, "top_p": 1.0}),
                None,
            )
        };
        tokio::join!(one(5), one(6))
    });
    for ((st, raw), want) in [got.0, got.1].iter().zip(&want) {
        assert_eq!(*st, 200, "{raw}");
        let v: Value = serde_json::from_str(raw).unwrap();
        assert_eq!(v["choices"][0]["text"], *want);
    }
    let (status, m) = get_now(&format!("{}/metrics", s.base)).expect("metrics");
    assert_eq!(status, 200);
    let count = |name: &str| -> i64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {m}"))
    };
    // Two requests of 6 + 70 tokens: checks at 16, 32, 48 and 64 of each; the shadow's last
    // verdicts may still be out.
    assert!(count("tinygpt_drift_checks ") >= 4, "{m}");
    assert_eq!(count("tinygpt_drift_events "), 0, "{m}");
}

/// More slots than the machine can hold caches for are refused with what they need, on the CPU
/// backend and on a software adapter (whose memory is the host's), before any cache is allocated
/// (they were an out-of-memory abort).
#[test]
fn slots_whose_caches_cannot_fit_are_refused_before_allocating() {
    for backend in ["cpu", "gpu"] {
        let o = bin()
            .args(["--backend", backend, "serve", "--port", "0"])
            .args([smollm2().to_str().unwrap(), "--parallel", "100000"])
            .stdout(Stdio::null())
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{backend}: {e}");
        assert!(!e.contains("panicked"), "{backend}: {e}");
        // The check needs the host's memory to be the caches': the CPU backend and software
        // adapters (CI's lavapipe); a GPU of its own memory fails its allocation instead.
        if backend == "cpu" || e.contains("slots of") {
            assert!(
                e.contains("100000 slots of")
                    && e.contains("GiB of KV cache")
                    && e.contains("lower --parallel or --ctx"),
                "{backend}: {e}"
            );
        }
    }
}
