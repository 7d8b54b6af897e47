//! The body of the `http` fuzz target (fuzz/fuzz_targets/http.rs), also replayed by the tests over its
//! corpus: one request from arbitrary bytes through the server's real router — routing, the API key,
//! body limits, JSON parsing, every parameter check, tokenization and the chat template — with an engine
//! that answers every queued request at once (the model is not what this exercises).
//!
//! Input: byte 0 picks the method and route, byte 1 the headers (content type, API key right, wrong or
//! missing, streaming), the rest is the body. Whatever it holds, the server must answer without
//! panicking, with no 5xx but the documented ones, and with OpenAI's error object on /v1 errors.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use tower::ServiceExt;

use super::engine::{Codec, Event, Finish, Job, Shared};
use super::http::{AppState, router};
use super::{ModelInfo, ServeArgs};

const ROUTES: [(&str, &str); 10] = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/SmolLM2-135M-Instruct"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/embeddings"),
    ("PUT", "/v1/completions"),
];

/// The API key the harness's server wants.
const KEY: &str = "fuzz-key";

struct Harness {
    rt: tokio::runtime::Runtime,
    app: Router,
}

/// The server: SmolLM2's tokenizer and chat template (the real file, from `TINYGPT_MODELS_DIR` or the
/// repository's .cache/models), and an engine that answers each request with one token of text.
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let tok = tinygpt_models::fuzzing::tokenizers().swap_remove(0);
        let template = tok.chat_template().map(|t| {
            tinygpt_models::chat_template::ChatTemplate::new(t).expect("SmolLM2's template")
        });
        let shared = Arc::new(Shared::default());
        let args = ServeArgs {
            model: None,
            host: [127, 0, 0, 1].into(),
            port: 0,
            api_key: None,
            api_key_file: None,
            parallel: Some(2),
            queue: Some(8),
            ctx: Some(64),
            cors_origin: vec!["http://example.test".into()],
            timeout: 5,
            max_body: 64 << 10,
            web_dir: Some(std::env::temp_dir().join("tinygpt-fuzz-no-playground")),
        };
        let state = AppState::new(shared.clone(), Some(KEY.into()), &args);
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::spawn(move || {
            for job in rx {
                shared.queued.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Text("ok".into()));
                let _ = job.events.send(Event::Done {
                    finish: Finish::Length,
                    completion_tokens: 1,
                });
            }
        });
        state.set_ready(
            ModelInfo {
                id: "SmolLM2-135M-Instruct".into(),
                bos: String::new(),
                eos: "<|im_end|>".into(),
                context: 64,
                parallel: 2,
                pills: vec![],
                gating: false,
                template,
                codec: Arc::new(Codec::Bpe(tok)),
                created: 0,
            },
            tx,
            8,
        );
        let app = router(state, &args).expect("the router builds");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        Harness { rt, app }
    })
}

/// One request from `data` (see the module docs); panics on a server panic or a broken answer.
pub fn request(data: &[u8]) {
    let h = harness();
    let (route, flags, body) = match data {
        [r, f, rest @ ..] => (*r, *f, rest),
        [r] => (*r, 0, &[][..]),
        [] => (0, 0, &[][..]),
    };
    let (method, path) = ROUTES[route as usize % ROUTES.len()];
    let mut req = Request::builder().method(method).uri(path);
    if flags & 1 != 0 {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    req = match (flags >> 1) & 3 {
        0 => req.header(header::AUTHORIZATION, format!("Bearer {KEY}")),
        1 => req.header(header::AUTHORIZATION, "Bearer wrong"),
        2 => req.header(
            header::AUTHORIZATION,
            String::from_utf8_lossy(&body[..body.len().min(8)]).into_owned(),
        ),
        _ => req,
    };
    if flags & 8 != 0 {
        req = req.header(header::ORIGIN, "http://example.test");
    }
    let Ok(req) = req.body(Body::from(body.to_vec())) else {
        // A header value the HTTP library refuses never reaches the server.
        return;
    };
    let v1 = path.starts_with("/v1") || path.ends_with("tokenize");
    h.rt.block_on(async {
        let resp = h
            .app
            .clone()
            .oneshot(req)
            .await
            .expect("the router answers");
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .expect("the whole answer arrives");
        assert!(
            !status.is_server_error() || status == StatusCode::SERVICE_UNAVAILABLE,
            "{method} {path}: status {status}: {}",
            String::from_utf8_lossy(&bytes)
        );
        if v1 && !status.is_success() {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!("{method} {path}: error body is not JSON ({e}): {bytes:?}")
            });
            assert!(
                v["error"]["message"].is_string(),
                "{method} {path}: not OpenAI's error object: {v}"
            );
        }
    });
}
