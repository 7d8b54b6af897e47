//! End-to-end tests of the `tinygpt` binary: training, resuming, sampling and the errors people meet.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{models_dir, smollm2};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
    c.env(
        "TINYGPT_CACHE_DIR",
        std::env::temp_dir().join("tinygpt-cli-test-cache"),
    );
    c
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tinygpt-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn text_file(dir: &Path) -> PathBuf {
    let p = dir.join("text.txt");
    std::fs::write(
        &p,
        "To be, or not to be, that is the question.\n".repeat(60),
    )
    .unwrap();
    p
}

const TINY: &[&str] = &[
    "--backend",
    "cpu",
    "--threads",
    "1",
    "train",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--block-size",
    "16",
    "--batch-size",
    "4",
    "--eval-iters",
    "2",
    "--log-every",
    "1",
    "--max-iters",
    "8",
    "--eval-every",
    "4",
];

/// `a` reading `data` and writing into `out`.
fn with_io<'a>(mut a: Vec<&'a str>, data: &'a Path, out: &'a Path) -> Vec<&'a str> {
    a.extend([
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    a
}

/// TINY with some of its flags given other values (or added).
fn tiny_with<'a>(set: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut a: Vec<&str> = Vec::new();
    let mut skip = false;
    for w in TINY {
        if skip {
            skip = false;
        } else if set.iter().any(|(f, _)| f == w) {
            skip = true;
        } else {
            a.push(w);
        }
    }
    for (f, v) in set {
        a.extend([*f, *v]);
    }
    a
}

fn losses(summary: &Path) -> Vec<(usize, f32)> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(summary).unwrap()).unwrap();
    serde_json::from_value(v["train_losses"].clone()).unwrap()
}

#[test]
fn resumed_training_gives_the_losses_of_an_uninterrupted_run() {
    let d = tmp("resume");
    let data = text_file(&d);
    let data = data.to_str().unwrap();
    let full = d.join("full");
    let part = d.join("part");
    let mut a = TINY.to_vec();
    a.extend(["--data", data, "--out", full.to_str().unwrap()]);
    let sa = d.join("a.json");
    let o = run(&[a.clone(), vec!["--summary", sa.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));

    let mut b = TINY.to_vec();
    b.extend(["--data", data, "--out", part.to_str().unwrap()]);
    let o = run(&[b.clone(), vec!["--stop-at", "4"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(part.join("resume/optimizer.safetensors").exists());
    let sb = d.join("b.json");
    let o = run(&[
        b,
        vec![
            "--resume",
            part.to_str().unwrap(),
            "--summary",
            sb.to_str().unwrap(),
        ],
    ]
    .concat());
    assert!(o.status.success(), "{}", stderr(&o));

    let (la, lb) = (losses(&sa), losses(&sb));
    assert_eq!(la.len(), 8);
    // The resumed run carries the first half's history and adds iterations 5..8.
    assert_eq!(la, lb, "resumed losses must equal the uninterrupted run's");
    // The loss curve and the model are written beside the checkpoint.
    assert!(full.join("model.safetensors").exists() && full.join("config.json").exists());
    let png = std::fs::read(full.join("loss.png")).expect("a loss curve beside the checkpoint");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_input_gets_one_clear_error_and_no_panic() {
    let d = tmp("bad");
    let check = |args: Vec<&str>, needle: &str| {
        let o = run(&args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(e.contains(needle), "{args:?}: expected {needle:?} in\n{e}");
        assert!(!e.contains("panicked"), "{args:?} panicked:\n{e}");
    };
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = d.join("binary.txt");
    std::fs::write(&binary, [0x61, 0x62, 0xff, 0xfe, 0x00]).unwrap();
    let short = d.join("short.txt");
    std::fs::write(&short, "a short text").unwrap();
    let out = d.join("out");
    let o = out.to_str().unwrap();
    check(
        vec![
            "--backend",
            "cpu",
            "train",
            "--data",
            empty.to_str().unwrap(),
            "--out",
            o,
        ],
        "empty",
    );
    check(
        vec![
            "--backend",
            "cpu",
            "train",
            "--data",
            binary.to_str().unwrap(),
            "--out",
            o,
        ],
        "not UTF-8",
    );
    check(
        vec![
            "--backend",
            "cpu",
            "train",
            "--data",
            short.to_str().unwrap(),
            "--out",
            o,
        ],
        "--block-size",
    );
    check(
        vec![
            "--backend",
            "cpu",
            "train",
            "--data",
            d.join("missing.txt").to_str().unwrap(),
        ],
        "cannot read",
    );
    check(
        vec![
            "--backend",
            "cpu",
            "generate",
            "--model",
            d.join("nowhere").to_str().unwrap(),
        ],
        "cannot load the model",
    );
    check(
        vec!["--backend", "cpu", "generate", "--prompt", "日本"],
        "cannot be encoded",
    );
    check(
        vec!["--backend", "cpu", "generate", "--temperature=-1"],
        "temperature",
    );
    check(vec!["--backend", "nope", "generate"], "unknown backend");
    check(
        vec!["--backend", "gpu", "--adapter", "no-such-adapter", "gates"],
        "no-such-adapter",
    );
    assert!(!out.exists(), "failed runs leave no output behind");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_checkpoint_of_another_config_is_refused_and_an_earlier_checkpoint_survives_a_failed_save() {
    let d = tmp("ckpt");
    let data = text_file(&d);
    let out = d.join("out");
    let a = with_io(TINY.to_vec(), &data, &out);
    assert!(run(&a).status.success());
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    // Claim another width in the config: the weights no longer fit it.
    let cfg = std::fs::read_to_string(out.join("config.json"))
        .unwrap()
        .replace("\"n_embd\": 16", "\"n_embd\": 32");
    std::fs::write(out.join("config.json"), cfg).unwrap();
    let o = run(&[
        "--backend",
        "cpu",
        "generate",
        "--model",
        out.to_str().unwrap(),
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("another config"),
        "{}",
        stderr(&o)
    );
    // A save that cannot happen (the output path is a file) fails cleanly; the earlier model is intact.
    let blocker = d.join("blocker");
    std::fs::write(&blocker, "not a directory").unwrap();
    let target = blocker.join("x");
    let mut b = TINY.to_vec();
    b.extend([
        "--data",
        data.to_str().unwrap(),
        "--out",
        target.to_str().unwrap(),
    ]);
    let o = run(&b);
    assert!(
        !o.status.success() && stderr(&o).contains("cannot create the checkpoint directory"),
        "{}",
        stderr(&o)
    );
    assert!(
        !stderr(&o).contains("iter "),
        "found before the first iteration"
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_checkpoint_is_never_replaced_by_surprise() {
    let d = tmp("surprise");
    let data = text_file(&d);
    let out = d.join("out");
    let a = with_io(TINY.to_vec(), &data, &out);
    let o = run(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    // The same command again refuses and says what to do; the checkpoint is untouched.
    let o = run(&a);
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains("already holds a checkpoint")
            && e.contains("--resume")
            && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    // --resume continues it in place (its directory is the default --out): nothing left to do at
    // --max-iters, and the message says so rather than claiming a new checkpoint.
    let mut r = TINY.to_vec();
    r.extend([
        "--data",
        data.to_str().unwrap(),
        "--resume",
        out.to_str().unwrap(),
    ]);
    let o = run(&r);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("nothing to do"), "{}", stderr(&o));
    // --overwrite replaces it with a new run's (another seed: other weights).
    let o = run(&[a.clone(), vec!["--overwrite", "--seed", "9"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A software adapter's memory is the host's: training that cannot fit it is refused before anything
/// is allocated, as on the CPU backend (on a hardware GPU its own allocations fail instead).
#[test]
fn training_too_large_for_a_software_adapter_is_refused_before_allocating() {
    let Some(be) = tinygpt_kernels::testing::gpu_backend(None) else {
        return;
    };
    if be.as_gpu().is_none_or(|g| !g.is_software()) {
        eprintln!("a hardware GPU: its memory is its own, nothing to check here");
        return;
    }
    let d = tmp("too-large-gpu");
    let data = text_file(&d);
    let out = d.join("out");
    let mut a = tiny_with(&[("--n-embd", "12000"), ("--batch-size", "65536")]);
    a[1] = "gpu";
    let o = run(&with_io(a, &data, &out));
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(e.contains("needs about") && e.contains("GiB"), "{e}");
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flags_that_cannot_mean_anything_are_refused_before_any_work() {
    let d = tmp("flags");
    let data = text_file(&d);
    let out = d.join("out");
    for (flag, value, needle) in [
        ("--batch-size", "0", "--batch-size 0"),
        ("--max-iters", "0", "--max-iters 0"),
        ("--lr", "NaN", "--lr NaN"),
        ("--n-layer", "100000", "number of layers"),
        ("--n-embd", "1048576", "width"),
    ] {
        let a = with_io(tiny_with(&[(flag, value)]), &data, &out);
        let o = run(&a);
        let e = stderr(&o);
        assert!(!o.status.success(), "{flag} {value}: {e}");
        assert!(
            e.contains(needle),
            "{flag} {value}: expected {needle:?} in {e}"
        );
        assert!(!e.contains("panicked"), "{e}");
        assert!(!out.exists(), "{flag} {value}: refused runs write nothing");
    }
    // A model and batch that no machine holds (about a terabyte of activations): refused by the
    // estimate, before anything is allocated.
    let a = with_io(
        tiny_with(&[("--n-embd", "12000"), ("--batch-size", "65536")]),
        &data,
        &out,
    );
    let o = run(&a);
    assert!(
        !o.status.success() && stderr(&o).contains("GiB"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
    // No threads, or more than any machine has; a drift-guard shadow of no threads.
    for (flag, threads) in [
        ("--threads", "0"),
        ("--threads", "100000"),
        ("--drift-threads", "0"),
    ] {
        let o = run(&["--backend", "cpu", flag, threads, "generate", "-n", "4"]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(flag), "{}", stderr(&o));
    }
    // Zero chunks of perplexity mean nothing (they were taken for one): refused before loading.
    let o = run(&[
        "--backend",
        "cpu",
        "perplexity",
        "no-such-model.gguf",
        data.to_str().unwrap(),
        "--chunks",
        "0",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--chunks 0"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_bundled_model_samples_reproducibly_on_the_cpu() {
    let sample = |seed: &str| run(&["--backend", "cpu", "generate", "-n", "120", "--seed", seed]);
    let (a, b, c) = (sample("5"), sample("5"), sample("6"));
    assert!(a.status.success(), "{}", stderr(&a));
    let text = String::from_utf8(a.stdout.clone()).unwrap();
    assert!(text.chars().count() >= 120, "{text:?}");
    assert_eq!(a.stdout, b.stdout, "same seed, same text");
    assert_ne!(a.stdout, c.stdout, "another seed, another text");
    assert!(stderr(&a).contains("ready to generate"));
}

#[test]
fn the_bundled_model_meets_its_validation_loss() {
    // The first 16 windows of 10 of the 200 fixed validation batches the training run used (all of
    // them take minutes on 2 cores); the bundled model scored 1.4764 on all 200 batches of 64.
    let o = run(&[
        "--backend",
        "cpu",
        "eval",
        "--eval-iters",
        "10",
        "--batch-size",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    let loss: f32 = s
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{s}"));
    assert!(loss <= 1.55, "val loss {loss} on 160 windows");
}

/// Runs the binary with a deadline: an input that hangs fails the test instead of stalling it.
fn run_within(args: &[&str], stdin: &[u8], secs: u64) -> Output {
    use std::io::Write;
    let mut child = bin()
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{args:?} did not finish within {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_directory_a_named_pipe_or_a_file_given_as_a_model_is_refused_at_once() {
    let d = tmp("not-models");
    let fifo = d.join("pipe.gguf");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let file = d.join("model.gguf");
    std::fs::write(&file, b"GGUF").unwrap();
    for (args, needle) in [
        (
            vec![
                "--backend",
                "cpu",
                "run",
                "--prompt",
                "Hi",
                d.to_str().unwrap(),
            ],
            "is a directory",
        ),
        (
            vec![
                "--backend",
                "cpu",
                "run",
                "--prompt",
                "Hi",
                fifo.to_str().unwrap(),
            ],
            "named pipe",
        ),
        (
            vec![
                "--backend",
                "cpu",
                "generate",
                "--model",
                file.to_str().unwrap(),
            ],
            "not a checkpoint directory",
        ),
    ] {
        let o = run_within(&args, b"", 30);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?}: {e}");
        assert!(e.contains(needle), "{args:?}: expected {needle:?} in {e}");
        assert_eq!(e.matches("error").count(), 1, "one error, said once: {e}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_chat_survives_a_line_of_invalid_utf8() {
    let model = smollm2();
    let input = [
        &b"\xff\xfe bad bytes\n"[..],
        &b"What is the capital of France?\n"[..],
    ]
    .concat();
    let o = run_within(
        &[
            "--backend",
            "cpu",
            "chat",
            model.to_str().unwrap(),
            "-n",
            "8",
            "--temperature",
            "0",
        ],
        &input,
        300,
    );
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("not valid UTF-8"), "{e}");
    assert!(
        !String::from_utf8_lossy(&o.stdout).trim().is_empty(),
        "the next line is answered: {e}"
    );
}

/// `chat` answers /help and an unknown /command itself (nothing goes to the model), and sends a
/// message written with two slashes with one.
#[test]
fn chat_commands_are_answered_and_unknown_ones_are_not_sent() {
    let model = smollm2();
    let args = [
        "--backend",
        "cpu",
        "chat",
        model.to_str().unwrap(),
        "-n",
        "4",
        "--temperature",
        "0",
    ];
    let o = run_within(&args, b"/help\n/frobnicate\n", 300);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("/reset starts the conversation over"), "{e}");
    assert!(e.contains("unknown command /frobnicate"), "{e}");
    assert!(
        String::from_utf8_lossy(&o.stdout).trim().is_empty(),
        "nothing was sent to the model: {e}"
    );
    let o = run_within(&args, b"//help\n", 300);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !String::from_utf8_lossy(&o.stdout).trim().is_empty(),
        "the message was answered: {}",
        stderr(&o)
    );
}

/// The slice of the bundled text the llama.cpp reference scored.
fn perplexity_text(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt"),
    )
    .unwrap();
    let slice: String = text.chars().skip(1_000_000).take(20_000).collect();
    let p = dir.join("slice.txt");
    std::fs::write(&p, slice).unwrap();
    p
}

#[test]
fn perplexity_matches_llama_cpp_within_one_percent() {
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/perplexity_llamacpp.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let d = tmp("ppl");
    let text = perplexity_text(&d);
    for (name, chunks) in [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", 4),
        ("gemma-3-270m-Q4_K_M.gguf", 2),
    ] {
        let model = models_dir().join(name);
        let o = run(&[
            "--backend",
            "cpu",
            "perplexity",
            model.to_str().unwrap(),
            text.to_str().unwrap(),
            "-c",
            "256",
            "--chunks",
            &chunks.to_string(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        let ours: f64 = out
            .split("Final estimate: PPL = ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no final estimate in {out}"));
        let theirs = reference["models"][name]["running"][chunks - 1]
            .as_f64()
            .unwrap();
        let rel = (ours - theirs).abs() / theirs;
        assert!(
            rel < 0.01,
            "{name}: ours {ours}, llama.cpp {theirs} ({:.2}% apart)",
            100.0 * rel
        );
    }
    // A text too short for two chunks is refused with what to do.
    let short = d.join("short.txt");
    std::fs::write(&short, "A short text.").unwrap();
    let o = run(&[
        "--backend",
        "cpu",
        "perplexity",
        smollm2().to_str().unwrap(),
        short.to_str().unwrap(),
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("smaller -c"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn gate_history_summarises_every_run_this_machine_recorded() {
    let cache = tmp("history");
    let with_cache = |args: &[&str]| {
        bin()
            .env("TINYGPT_CACHE_DIR", &cache)
            .args(args)
            .output()
            .expect("the binary runs")
    };
    let o = with_cache(&["gates", "--history"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("no gate runs recorded yet"));
    // Two measured runs on the GPU (the second forced past the cache), one cached.
    for extra in [&[][..], &["--regate"][..], &[][..]] {
        let o = with_cache(&[&["--backend", "gpu", "gates"][..], extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // A damaged line is skipped and counted, not fatal.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(cache.join("gate-history.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"{ not a record\n").unwrap();
    let o = with_cache(&["gates", "--history", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["unreadable_lines"], 1);
    let adapters = v["adapters"].as_array().unwrap();
    assert_eq!(adapters.len(), 1, "{v}");
    let paths = adapters[0]["paths"].as_object().unwrap();
    assert!(!paths.is_empty(), "{v}");
    for (name, h) in paths {
        assert_eq!(h["runs"], 2, "{name}: {h}");
        assert_eq!(
            h["passes"].as_u64().unwrap() + h["fails"].as_u64().unwrap(),
            2
        );
    }
    let o = with_cache(&["gates", "--history"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("2 runs") && text.contains("UTC"), "{text}");
    // A drift-guard event, as `run` records one, is listed under its adapter.
    let event = serde_json::json!({"kind": "drift", "time_unix": 1_796_000_000u64,
        "adapter": adapters[0]["adapter"], "driver": adapters[0]["driver"],
        "subject": "SmolLM2-135M-Instruct", "position": 511, "kl": 0.25, "bound": 0.001,
        "same_top1": 3, "checks": 4, "paths": ["q8-matmul"]});
    std::io::Write::write_all(&mut f, format!("{event}\n").as_bytes()).unwrap();
    let o = with_cache(&["gates", "--history", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["unreadable_lines"], 1, "{v}");
    assert_eq!(v["adapters"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["adapters"][0]["drift_events"][0][1], 511, "{v}");
    let o = with_cache(&["gates", "--history"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("drift guard    1 event\n")
            && text.contains("SmolLM2-135M-Instruct: position 511")
            && text.contains("q8-matmul turned off"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_model_exports_to_gguf_and_hugging_face_and_both_run_and_train_on() {
    let dir = tmp("export");
    let data = text_file(&dir);
    let out = dir.join("model");
    let first = dir.join("first.json");
    // Enough learning that a trained model's loss stands well below a fresh one's.
    let fast = [
        ("--max-iters", "40"),
        ("--warmup", "0"),
        ("--lr", "1e-2"),
        ("--eval-every", "40"),
    ];
    let mut a = with_io(tiny_with(&fast), &data, &out);
    a.extend(["--summary", first.to_str().unwrap()]);
    let t = run(&a);
    assert!(t.status.success(), "{}", stderr(&t));
    let (gguf, hf) = (dir.join("model.gguf"), dir.join("hf"));
    let (g, h) = (gguf.to_str().unwrap(), hf.to_str().unwrap());
    let m = out.to_str().unwrap();
    let e = run(&["export", m, "--gguf", g, "--hf", h]);
    assert!(e.status.success(), "{}", stderr(&e));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(hf.join(f).is_file(), "{f}");
    }

    // What is there is never replaced by surprise.
    let before = std::fs::read(&gguf).unwrap();
    let again = run(&["export", m, "--gguf", g]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--overwrite"), "{}", stderr(&again));
    assert_eq!(std::fs::read(&gguf).unwrap(), before);
    let again = run(&["export", m, "--hf", h]);
    assert!(
        stderr(&again).contains("already holds config.json"),
        "{}",
        stderr(&again)
    );
    // Q8_0 needs whole 32-wide blocks; this model is 16 wide.
    let q8 = dir.join("q8.gguf");
    let o = run(&[
        "export",
        m,
        "--gguf",
        q8.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert!(
        stderr(&o).contains("export it as F16 or F32"),
        "{}",
        stderr(&o)
    );
    assert!(!q8.exists());
    assert!(!run(&["export", m]).status.success(), "no target given");

    // The same greedy text from the checkpoint, its Hugging Face export and its GGUF export.
    let greedy = |model: &str| {
        let o = run(&[
            "--backend",
            "cpu",
            "generate",
            "--model",
            model,
            "--prompt",
            "To be",
            "-n",
            "40",
            "--temperature",
            "0",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8(o.stdout).unwrap()
    };
    let want = greedy(m);
    assert_eq!(greedy(h), want);
    let r = run(&[
        "--backend",
        "cpu",
        "run",
        g,
        "-p",
        "To be",
        "-n",
        "40",
        "--temperature",
        "0",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(
        String::from_utf8(r.stdout).unwrap().trim_end(),
        want.trim_end()
    );

    // Training continues from the export: its first loss is the trained model's, not a fresh one's.
    let shape = ["--n-layer", "--n-head", "--n-embd", "--block-size"];
    let from_export = |extra: &[&str], out: &Path| -> Output {
        let mut a: Vec<&str> = Vec::new();
        let mut skip = false;
        for w in with_io(tiny_with(&[("--max-iters", "4")]), &data, out) {
            if std::mem::take(&mut skip) {
                continue;
            }
            skip = shape.contains(&w);
            if !skip {
                a.push(w);
            }
        }
        a.extend(["--init-from", h]);
        a.extend(extra);
        run(&a)
    };
    let second = dir.join("second.json");
    let t2 = from_export(&["--summary", second.to_str().unwrap()], &dir.join("again"));
    assert!(t2.status.success(), "{}", stderr(&t2));
    let (fresh, resumed) = (losses(&first), losses(&second));
    let trained = fresh.last().unwrap().1;
    eprintln!(
        "first losses: fresh {}, from the export {}; trained {trained}",
        fresh[0].1, resumed[0].1
    );
    assert!(
        resumed[0].1 < fresh[0].1 - 0.3 && (resumed[0].1 - trained).abs() < 0.3,
        "first loss from the export {}, a fresh model's {}, the trained model's last {trained}",
        resumed[0].1,
        fresh[0].1
    );

    // A shape flag next to --init-from, and a text with characters the model lacks, are refused.
    let b = from_export(&["--n-layer", "2"], &dir.join("x"));
    assert!(stderr(&b).contains("cannot be used with"), "{}", stderr(&b));
    let other = dir.join("other.txt");
    std::fs::write(&other, "Zebras! ".repeat(100)).unwrap();
    let b = run(&[
        "--backend",
        "cpu",
        "train",
        "--max-iters",
        "2",
        "--init-from",
        h,
        "--data",
        other.to_str().unwrap(),
        "--out",
        dir.join("y").to_str().unwrap(),
    ]);
    assert!(
        stderr(&b).contains("not in the model's vocabulary"),
        "{}",
        stderr(&b)
    );
}

#[test]
fn kl_divergence_compares_the_gated_fast_paths_with_the_f32_path() {
    if std::env::var("TINYGPT_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        return;
    }
    let d = tmp("kld");
    let text = perplexity_text(&d);
    // A tiny Q8_0 model (tests/data/qwen): its quantized kernels are a fast path once gated.
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/qwen/qwen2.q8_0.gguf");
    let args = |backend: &'static str| {
        vec![
            "--backend".to_string(),
            backend.into(),
            "--low-end".into(),
            "perplexity".into(),
            model.to_str().unwrap().into(),
            text.to_str().unwrap().into(),
            "-c".into(),
            "64".into(),
            "--chunks".into(),
            "3".into(),
            "--kl-divergence".into(),
        ]
    };
    // The GPU's gated paths, then the CPU backend's (`int-dot`, where the CPU has AVX-512 VNNI).
    for backend in ["gpu", "cpu"] {
        let o = bin().args(args(backend)).output().expect("the binary runs");
        if backend == "cpu" && !tinygpt_kernels::ops::matmul::quant::cpu_int::int_dot_available() {
            // No fast path on this CPU: nothing to compare, one clear error.
            assert!(!o.status.success());
            assert!(stderr(&o).contains("nothing to compare"), "{}", stderr(&o));
            continue;
        }
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let rows: Vec<&str> = out.lines().skip(1).collect();
        assert!(!rows.is_empty(), "{out}");
        for row in &rows {
            // fast paths .. PPL(f32) PPL(fast) ratio mean ± err max same%
            let f: Vec<&str> = row.split_whitespace().collect();
            let n = f.len();
            let (ppl_base, ppl_fast): (f64, f64) =
                (f[n - 8].parse().unwrap(), f[n - 7].parse().unwrap());
            let ratio: f64 = f[n - 6].parse().unwrap();
            let kl: f64 = f[n - 5].parse().unwrap();
            let same: f64 = f[n - 1].trim_end_matches('%').parse().unwrap();
            assert!(ppl_base > 1.0 && ppl_fast > 1.0, "{row}");
            assert!((ratio - ppl_fast / ppl_base).abs() < 1e-3, "{row}");
            // The gate passed these paths: their distributions stay close to the f32 path's.
            assert!((0.0..1e-3).contains(&kl), "{backend}: {row}");
            assert!(same >= 95.0, "{backend}: {row}");
        }
        if backend == "cpu" {
            assert!(out.contains("int-dot") || out.contains("int dot"), "{out}");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The first `run` on an adapter whose gates have not run yet does not wait for them: the model is
/// ready on the f32 path before the token gate has finished (it runs on a thread of its own), the
/// verdict is stored before the run ends, and the next start uses it at once. Both runs, and the
/// f32 path alone, give the same greedy tokens.
#[test]
fn the_first_run_on_an_ungated_adapter_starts_on_the_f32_path_at_once() {
    if std::env::var("TINYGPT_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") {
        return;
    }
    let cache = tmp("background-gate");
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/qwen/qwen2.q8_0.gguf");
    let greedy = |extra: &[&str]| {
        let o = bin()
            .env("TINYGPT_CACHE_DIR", &cache)
            .args(["--backend", "gpu"])
            .args(extra)
            .arg("run")
            .arg(&model)
            .args(["-p", "Hello", "-n", "24", "--temperature", "0"])
            .args(["--format", "json"])
            .output()
            .expect("the binary runs");
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        (v["generated_ids"].clone(), stderr(&o))
    };
    let (f32_ids, _) = greedy(&["--f32-only"]);
    let (cold_ids, cold) = greedy(&[]);
    let lines: Vec<&str> = cold.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{cold}"))
    };
    assert!(
        cold.contains("gating the fast paths in the background"),
        "{cold}"
    );
    let ready = at("ready.");
    assert!(lines[ready].contains("gating…"), "{cold}");
    assert!(
        ready < at("token gate:"),
        "the model is ready before the token gate decides:\n{cold}"
    );
    // Its verdict arrives during the run (the model moves) or is awaited at the end.
    assert!(
        cold.contains("fast paths gated in") || cold.contains("the next start uses them"),
        "{cold}"
    );
    assert_eq!(cold_ids, f32_ids, "{cold}");
    let (warm_ids, warm) = greedy(&[]);
    assert!(!warm.contains("background"), "{warm}");
    assert!(warm.contains("token gate: cached verdict"), "{warm}");
    assert!(warm.contains("+q8 matmul"), "{warm}");
    assert_eq!(warm_ids, f32_ids, "{warm}");
    let _ = std::fs::remove_dir_all(&cache);
}

/// `eval` on the CPU backend defaults to a size that finishes in well under a minute (and says how many
/// batches it used and how to get training's 200); zero batches is refused.
#[test]
fn eval_on_the_cpu_defaults_to_a_short_run_and_says_so() {
    let o = run(&["--backend", "cpu", "eval", "--batch-size", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("(10 batches of 4 x 256 characters"), "{out}");
    assert!(stderr(&o).contains("--eval-iters 200"), "{}", stderr(&o));
    let o = run(&["--backend", "cpu", "eval", "--eval-iters", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("at least 1 batch"), "{}", stderr(&o));
}

/// A model trained with `--block-size 1` generates, on the CPU backend and on a GPU: every token past
/// the first restarts the (full) cache from the last token.
#[test]
fn a_model_of_block_one_generates_on_both_backends() {
    let dir = tmp("block-one");
    let data = text_file(&dir);
    let out = dir.join("out");
    let o = run(&with_io(tiny_with(&[("--block-size", "1")]), &data, &out));
    assert!(o.status.success(), "{}", stderr(&o));
    let model = out.to_str().unwrap();
    for backend in ["cpu", "gpu"] {
        let o = run(&[
            "--backend",
            backend,
            "generate",
            "--model",
            model,
            "--prompt",
            "To",
            "-n",
            "40",
            "--seed",
            "3",
        ]);
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        let text = String::from_utf8(o.stdout).unwrap();
        assert_eq!(
            text.strip_suffix('\n')
                .and_then(|t| t.strip_prefix("To"))
                .map(|t| t.chars().count()),
            Some(40),
            "{backend}: {text:?}"
        );
    }
}

/// A model whose training text had no newline generates with no --prompt (from its first character,
/// saying so) on the CPU backend and on a GPU, the same text on both for the same seed.
#[test]
fn a_model_without_a_newline_generates_without_a_prompt() {
    let dir = tmp("no-newline");
    let data = dir.join("text.txt");
    std::fs::write(&data, "to be or not to be that is the question ".repeat(60)).unwrap();
    let out = dir.join("out");
    let o = run(&with_io(TINY.to_vec(), &data, &out));
    assert!(o.status.success(), "{}", stderr(&o));
    let model = out.to_str().unwrap();
    let mut texts = Vec::new();
    for backend in ["cpu", "gpu"] {
        let o = run(&[
            "--backend",
            backend,
            "generate",
            "--model",
            model,
            "-n",
            "30",
            "--seed",
            "5",
            "--temperature",
            "0",
        ]);
        assert!(o.status.success(), "{backend}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("had no newline to start from; starting from \" \""),
            "{backend}: {}",
            stderr(&o)
        );
        let text = String::from_utf8(o.stdout).unwrap();
        assert_eq!(text.chars().count(), 1 + 30 + 1, "{backend}: {text:?}");
        texts.push(text);
    }
    assert_eq!(texts[0], texts[1]);
}

/// The boolean environment variables take 1 and 0 as well as true and false (as shells and CI files
/// set them), and `tinygpt gates` on the CPU backend shows the CPU's own paths.
#[test]
fn boolean_environment_variables_take_one_and_zero() {
    for (value, off) in [("1", true), ("true", true), ("0", false), ("false", false)] {
        let o = bin()
            .env("TINYGPT_F32_ONLY", value)
            .args(["--backend", "cpu", "gates"])
            .output()
            .expect("the binary runs");
        assert!(
            o.status.success(),
            "TINYGPT_F32_ONLY={value}: {}",
            stderr(&o)
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            out.contains("no fast paths to gate (--f32-only)"),
            off,
            "{value}: {out}"
        );
        if !off {
            assert!(out.contains("int dot"), "the CPU's path is listed: {out}");
        }
    }
}
