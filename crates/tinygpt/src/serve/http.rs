//! The routes: one handler each (axum's style), shared state in `State<Arc<AppState>>`, errors as
//! [`ApiError`] in OpenAI's format.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tinygpt_models::sampler::SamplerConfig;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::api::{
    ApiError, ChatRequest, CompletionRequest, Content, DetokenizeRequest, JsonBody, Prompt,
    Sampling, Stop, TokenizeRequest, Usage, parse,
};
use super::engine::{Event, Finish, Job, Shared};
use super::{ModelInfo, ServeArgs};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartLabels {
    part: &'static str,
}

/// Prometheus metrics (served as text at /metrics).
struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    queue: Gauge,
    active: Gauge,
    decode_tps: Gauge<f64, AtomicU64>,
    fast_paths: Family<PathLabels, Gauge>,
    drift_checks: Gauge,
    drift_events: Gauge,
    drift_seconds: Family<PartLabels, Gauge<f64, AtomicU64>>,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("tinygpt");
        let requests = Family::<RequestLabels, Counter>::default();
        let prompt_tokens = Counter::default();
        let completion_tokens = Counter::default();
        let queue = Gauge::default();
        let active = Gauge::default();
        let decode_tps = Gauge::<f64, AtomicU64>::default();
        let fast_paths = Family::<PathLabels, Gauge>::default();
        let drift_checks = Gauge::default();
        let drift_events = Gauge::default();
        let drift_seconds = Family::<PartLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "requests",
            "HTTP requests by route and status",
            requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens processed",
            prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Completion tokens generated",
            completion_tokens.clone(),
        );
        registry.register("queue_depth", "Requests waiting for a slot", queue.clone());
        registry.register("active_slots", "Requests being decoded", active.clone());
        registry.register(
            "decode_tokens_per_second",
            "Aggregate decode rate over recent steps",
            decode_tps.clone(),
        );
        registry.register(
            "fast_path_active",
            "Fast paths the model runs on (1 = active)",
            fast_paths.clone(),
        );
        registry.register(
            "drift_checks",
            "Decode steps the drift guard computed again on the f32 path",
            drift_checks.clone(),
        );
        registry.register(
            "drift_events",
            "Drift-guard checks past the bound (the fast paths then turn off)",
            drift_events.clone(),
        );
        registry.register(
            "drift_guard_seconds",
            "Time the drift guard has taken: the engine's checks between decode steps (part=engine, \
             of which part=cache_reads read the checked sequences' cache rows) and the shadow's f32 \
             steps on its own thread (part=shadow)",
            drift_seconds.clone(),
        );
        Metrics {
            registry,
            requests,
            prompt_tokens,
            completion_tokens,
            queue,
            active,
            decode_tps,
            fast_paths,
            drift_checks,
            drift_events,
            drift_seconds,
        }
    }
}

/// Everything the handlers share.
pub struct AppState {
    shared: Arc<Shared>,
    key: Option<String>,
    info: OnceLock<ModelInfo>,
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    queue_limit: AtomicUsize,
    timeout: Duration,
    metrics: Metrics,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(shared: Arc<Shared>, key: Option<String>, a: &ServeArgs) -> Arc<Self> {
        Arc::new(AppState {
            shared,
            key,
            info: OnceLock::new(),
            jobs: Mutex::new(None),
            queue_limit: AtomicUsize::new(0),
            timeout: Duration::from_secs(a.timeout.max(1)),
            metrics: Metrics::new(),
            next_id: AtomicU64::new(1),
        })
    }

    /// The model is loaded: requests are taken from now on.
    pub fn set_ready(&self, info: ModelInfo, jobs: std::sync::mpsc::Sender<Job>, queue: usize) {
        self.shared.set_paths(info.pills.clone());
        let _ = self.info.set(info);
        self.queue_limit.store(queue, Ordering::Relaxed);
        if let Ok(mut j) = self.jobs.lock() {
            *j = Some(jobs);
        }
    }

    /// No new requests (shutdown): the engine sees the queue close.
    pub fn close_queue(&self) {
        if let Ok(mut j) = self.jobs.lock() {
            *j = None;
        }
    }

    fn ready(&self) -> Result<&ModelInfo, ApiError> {
        if self.shared.stopping.load(Ordering::Relaxed) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
            ));
        }
        self.info.get().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the model is still loading; retry shortly (GET /health says when it is ready)",
            )
        })
    }

    fn id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:x}{:06x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// The router: /v1 routes (behind the API key when there is one), health, metrics, tokenization, and
/// the playground at / (with the headers that let a page use threads in wasm).
pub fn router(state: Arc<AppState>, a: &ServeArgs) -> Result<Router> {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let web = crate::paths::web_dir(a.web_dir.as_deref());
    let playground = Router::new()
        .fallback_service(
            tower_http::services::ServeDir::new(&web).fallback(get(move || {
                let web = web.clone();
                async move { playground_missing(&web) }
            })),
        )
        .layer(tower_http::set_header::SetResponseHeaderLayer::overriding(
            HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        ))
        .layer(tower_http::set_header::SetResponseHeaderLayer::overriding(
            HeaderName::from_static("cross-origin-embedder-policy"),
            HeaderValue::from_static("require-corp"),
        ));
    let mut app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .nest_service(
            "/v1",
            Router::new().fallback(not_found).with_state(state.clone()),
        )
        .fallback_service(playground)
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(DefaultBodyLimit::max(a.max_body))
        .with_state(state);
    if !a.cors_origin.is_empty() {
        let origins = a
            .cors_origin
            .iter()
            .map(|o| {
                HeaderValue::from_str(o)
                    .map_err(|_| anyhow::anyhow!("--cors-origin {o:?} is not a valid origin"))
            })
            .collect::<Result<Vec<_>>>()?;
        app = app.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
        );
    }
    Ok(app)
}

fn playground_missing(web: &std::path::Path) -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        format!(
            "<!doctype html><title>TinyGPT</title><p>The playground is not built ({} is missing). Run \
             <code>bash scripts/build-web.sh</code>, or pass <code>--web-dir</code>. The API is at \
             <code>/v1</code>.</p>",
            web.join("index.html").display()
        ),
    )
        .into_response()
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
    .with_code("unknown_url")
}

/// A known route asked with a method it does not take (axum's own answer has no body).
async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "{} does not take {} requests (GET /v1/models lists models; completions are POST)",
            req.uri().path(),
            req.method()
        ),
    )
    .with_code("method_not_allowed")
}

/// Counts every response by route and status.
async fn count(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req.uri().path().to_string();
    let route = match route.as_str() {
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/models"
        | "/health"
        | "/metrics"
        | "/tokenize"
        | "/detokenize" => route,
        r if r.starts_with("/v1/") => "/v1/other".into(),
        _ => "/web".into(),
    };
    let res = next.run(req).await;
    st.metrics
        .requests
        .get_or_create(&RequestLabels {
            route,
            status: res.status().as_u16(),
        })
        .inc();
    res
}

/// `Authorization: Bearer KEY`, compared in constant time.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key: send `Authorization: Bearer KEY`",
            )
            .with_code("invalid_api_key")
            .into_response();
        }
    }
    next.run(req).await
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.info.get().is_some() && !st.shared.stopping.load(Ordering::Relaxed) {
        Json(json!({"status": "ok"})).into_response()
    } else {
        let status = if st.shared.stopping.load(Ordering::Relaxed) {
            "stopping"
        } else {
            "loading"
        };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": status})),
        )
            .into_response()
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    m.queue.set(st.shared.queued.load(Ordering::Relaxed) as i64);
    m.active
        .set(st.shared.active.load(Ordering::Relaxed) as i64);
    m.decode_tps.set(st.shared.decode_tps());
    m.drift_checks
        .set(st.shared.drift_checks.load(Ordering::Relaxed) as i64);
    m.drift_events
        .set(st.shared.drift_events.load(Ordering::Relaxed) as i64);
    let d = st.shared.drift_secs();
    for (part, v) in [
        ("engine", d.engine),
        ("cache_reads", d.cache_reads),
        ("shadow", d.shadow),
    ] {
        m.drift_seconds.get_or_create(&PartLabels { part }).set(v);
    }
    // The model moves to its fast paths when background gating passes them, and off them when the
    // drift guard trips.
    if let Ok(paths) = st.shared.paths.lock() {
        m.fast_paths.clear();
        for p in paths.iter() {
            m.fast_paths
                .get_or_create(&PathLabels {
                    path: p.trim_start_matches('+').to_string(),
                })
                .set(1);
        }
    }
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &m.registry) {
        return ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        )
        .into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_object(info: &ModelInfo) -> Value {
    json!({"id": info.id, "object": "model", "created": info.created, "owned_by": "tinygpt"})
}

async fn models(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let info = st.ready()?;
    Ok(Json(
        json!({"object": "list", "data": [model_object(info)]}),
    ))
}

async fn model(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let info = st.ready()?;
    check_model(info, Some(&id))?;
    Ok(Json(model_object(info)))
}

fn check_model(info: &ModelInfo, asked: Option<&str>) -> Result<(), ApiError> {
    match asked {
        Some(m) if m != info.id => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model '{m}' does not exist; this server serves '{}'",
                    info.id
                ),
            )
            .with_code("model_not_found")
        }),
        _ => Ok(()),
    }
}

async fn tokenize(
    State(st): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let info = st.ready()?;
    let req: TokenizeRequest = parse(&body)?;
    let mut ids = info
        .codec
        .encode(&req.content)
        .map_err(|e| ApiError::bad_request(Some("content"), e))?;
    // The codec adds BOS as a prompt gets it; `add_special: false` asks for the bare text's tokens.
    if !req.add_special && info.codec.adds_bos() && !ids.is_empty() {
        ids.remove(0);
    }
    Ok(Json(json!({"tokens": ids})))
}

async fn detokenize(
    State(st): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let info = st.ready()?;
    let req: DetokenizeRequest = parse(&body)?;
    let n = info.codec.n_vocab();
    let ids = req
        .tokens
        .iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&u| (u as usize) < n)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        Some("tokens"),
                        format!("token {t} is outside the vocabulary of {n}"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let content = info
        .codec
        .decode(&ids)
        .map_err(|e| ApiError::bad_request(Some("tokens"), e))?;
    Ok(Json(json!({"content": content})))
}

/// The sampling settings of one request, checked.
struct Params {
    max_tokens: Option<usize>,
    sampler: SamplerConfig,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

/// Checks `s`: every value we cannot honour is a 400 that names its parameter.
fn params(s: &Sampling, chat: bool) -> Result<Params, ApiError> {
    if let Some(n) = s.n
        && n != 1
    {
        return Err(ApiError::unsupported(
            "n",
            format!("n = {n}: only n = 1 is supported"),
        ));
    }
    if let Some(b) = s.best_of
        && b != 1
    {
        return Err(ApiError::unsupported(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    let off = |name: &str, set: bool| -> Result<(), ApiError> {
        if set {
            Err(ApiError::unsupported(
                name,
                format!("{name} is not supported by this server"),
            ))
        } else {
            Ok(())
        }
    };
    off(
        "logprobs",
        s.logprobs
            .as_ref()
            .is_some_and(|v| !(v.is_null() || v == &json!(false))),
    )?;
    off(
        "top_logprobs",
        s.top_logprobs.as_ref().is_some_and(|v| !v.is_null()),
    )?;
    off(
        "tools",
        s.tools
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &json!([])),
    )?;
    off(
        "tool_choice",
        s.tool_choice
            .as_ref()
            .is_some_and(|v| !(v.is_null() || v == "none" || v == "auto")),
    )?;
    off(
        "logit_bias",
        s.logit_bias
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != &json!({})),
    )?;
    off("echo", s.echo == Some(true))?;
    off("suffix", s.suffix.as_ref().is_some_and(|v| !v.is_empty()))?;
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        off(name, v.is_some_and(|v| v != 0.0))?;
    }
    if let Some(rf) = &s.response_format {
        let kind = rf.get("type").and_then(Value::as_str).unwrap_or("");
        off("response_format", kind != "text")?;
    }
    let max = match (
        s.max_tokens,
        if chat { s.max_completion_tokens } else { None },
    ) {
        (Some(v), _) | (None, Some(v)) => {
            if v < 1 {
                let name = if s.max_tokens.is_some() {
                    "max_tokens"
                } else {
                    "max_completion_tokens"
                };
                return Err(ApiError::bad_request(
                    Some(name),
                    format!("{name} = {v}: it must be at least 1"),
                ));
            }
            Some(v as usize)
        }
        (None, None) => None,
    };
    let temperature = s.temperature.unwrap_or(0.8);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(
            Some("temperature"),
            format!("temperature = {temperature}: it must be between 0 and 2"),
        ));
    }
    let top_p = s.top_p.unwrap_or(0.95);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(
            Some("top_p"),
            format!("top_p = {top_p}: it must be in (0, 1]"),
        ));
    }
    let top_k = s.top_k.unwrap_or(40);
    if top_k < 0 {
        return Err(ApiError::bad_request(
            Some("top_k"),
            format!("top_k = {top_k}: it must be 0 (off) or more"),
        ));
    }
    let seed = match s.seed {
        Some(v) => v as u64,
        // No seed: a different one per request, as OpenAI and llama.cpp do.
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    let stop = match &s.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 {
        return Err(ApiError::bad_request(
            Some("stop"),
            "at most 4 stop strings",
        ));
    }
    Ok(Params {
        max_tokens: max,
        sampler: SamplerConfig {
            temperature: temperature as f32,
            top_k: top_k as usize,
            top_p: top_p as f32,
            seed,
        },
        stop,
        stream: s.stream,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: s.ignore_eos,
    })
}

/// Which endpoint a request came from: the objects and chunks differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(
    State(st): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let info = st.ready()?;
    let (req, sampling): (ChatRequest, Sampling) = (parse(&body)?, parse(&body)?);
    check_model(info, sampling.model.as_deref())?;
    let p = params(&sampling, true)?;
    let Some(template) = &info.template else {
        return Err(ApiError::bad_request(
            Some("messages"),
            format!(
                "the model '{}' has no chat template: use /v1/completions",
                info.id
            ),
        ));
    };
    if req.messages.is_empty() {
        return Err(ApiError::bad_request(Some("messages"), "messages is empty"));
    }
    let mut msgs: Vec<(String, String)> = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        ) {
            return Err(ApiError::bad_request(
                Some(&format!("messages[{i}].role")),
                format!(
                    "role '{}' is not supported (system, developer, user, assistant)",
                    m.role
                ),
            ));
        }
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(x)) => t.push_str(x),
                        (k, _) => {
                            return Err(ApiError::unsupported(
                                &format!("messages[{i}].content[{j}].type"),
                                format!(
                                    "content parts of type '{k}' are not supported (text only)"
                                ),
                            ));
                        }
                    }
                }
                t
            }
        };
        // OpenAI's "developer" role is the system prompt of newer models.
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role.clone()
        };
        msgs.push((role, text));
    }
    let pairs: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
    let prompt = template
        .render(&pairs, true, &info.bos, &info.eos)
        .map_err(|e| {
            ApiError::bad_request(Some("messages"), format!("the chat template failed: {e}"))
        })?;
    let ids = info
        .codec
        .encode(&prompt)
        .map_err(|e| ApiError::bad_request(Some("messages"), e))?;
    submit(st.clone(), ids, p, Kind::Chat).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let info = st.ready()?;
    let (req, sampling): (CompletionRequest, Sampling) = (parse(&body)?, parse(&body)?);
    check_model(info, sampling.model.as_deref())?;
    let p = params(&sampling, false)?;
    let text = match &req.prompt {
        Prompt::One(s) => s.clone(),
        Prompt::Many(v) if v.len() == 1 => v[0].clone(),
        Prompt::Many(v) => {
            return Err(ApiError::unsupported(
                "prompt",
                format!("{} prompts in one request: send one per request", v.len()),
            ));
        }
    };
    let ids = info
        .codec
        .encode(&text)
        .map_err(|e| ApiError::bad_request(Some("prompt"), e))?;
    if ids.is_empty() {
        return Err(ApiError::bad_request(Some("prompt"), "the prompt is empty"));
    }
    submit(st.clone(), ids, p, Kind::Completion).await
}

/// Queues the request and answers it: a stream of chunks, or one object when it is done.
async fn submit(
    st: Arc<AppState>,
    ids: Vec<u32>,
    p: Params,
    kind: Kind,
) -> Result<Response, ApiError> {
    let info = st.ready()?;
    let started = Instant::now();
    let n_prompt = ids.len();
    if info.context != usize::MAX && n_prompt >= info.context {
        return Err(ApiError::bad_request(
            Some(if kind == Kind::Chat { "messages" } else { "prompt" }),
            format!(
                "the prompt is {n_prompt} tokens; the context holds {} (one more for the reply): shorten it",
                info.context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = if info.context == usize::MAX {
        usize::MAX
    } else {
        info.context - n_prompt
    };
    let default_max = if info.context == usize::MAX {
        256
    } else {
        room
    };
    let max_tokens = p.max_tokens.unwrap_or(default_max).min(room);
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt: ids,
        max_tokens,
        sampler: p.sampler,
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos,
        deadline: started + st.timeout,
        events: tx,
    };
    {
        let limit = st.queue_limit.load(Ordering::Relaxed);
        if st.shared.queued.load(Ordering::Relaxed) >= limit {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("{limit} requests are already waiting for a slot; retry shortly"),
            )
            .with_code("queue_full"));
        }
        let jobs = st.jobs.lock().map_err(|_| unavailable())?;
        let Some(jobs) = jobs.as_ref() else {
            return Err(unavailable());
        };
        st.shared.queued.fetch_add(1, Ordering::Relaxed);
        if jobs.send(job).is_err() {
            st.shared.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(unavailable());
        }
    }
    st.metrics.prompt_tokens.inc_by(n_prompt as u64);
    let id = st.id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let reply = Reply {
        st: st.clone(),
        id,
        kind,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        n_prompt,
        started,
    };
    if p.stream {
        Ok(stream(reply, rx, p.include_usage).into_response())
    } else {
        whole(reply, rx).await
    }
}

fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the server is shutting down",
    )
}

/// What every chunk and the final object of one request share.
struct Reply {
    st: Arc<AppState>,
    id: String,
    kind: Kind,
    created: u64,
    n_prompt: usize,
    started: Instant,
}

impl Reply {
    fn model(&self) -> &str {
        self.st.info.get().map_or("", |i| i.id.as_str())
    }

    fn chunk(&self, delta_text: Option<&str>, first: bool, finish: Option<Finish>) -> Value {
        let finish = finish.map(Finish::as_str);
        match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = delta_text {
                    delta["content"] = json!(t);
                }
                json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model(),
                       "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
            }
            Kind::Completion => {
                json!({"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model(),
                "choices": [{"index": 0, "text": delta_text.unwrap_or(""), "logprobs": null,
                             "finish_reason": finish}]})
            }
        }
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model(),
               "choices": [], "usage": usage})
    }

    /// Counts the tokens and logs the request's line.
    fn done(&self, status: u16, usage: Usage) {
        self.st
            .metrics
            .completion_tokens
            .inc_by(usage.completion_tokens as u64);
        eprintln!(
            "{} {} · {} prompt + {} completion tokens · {:.2} s",
            match self.kind {
                Kind::Chat => "POST /v1/chat/completions",
                Kind::Completion => "POST /v1/completions",
            },
            status,
            usage.prompt_tokens,
            usage.completion_tokens,
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// Waits for the whole completion and answers with one object.
async fn whole(reply: Reply, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done {
                finish,
                completion_tokens,
            }) => {
                let usage = Usage::new(reply.n_prompt, completion_tokens);
                reply.done(200, usage);
                let choice = match reply.kind {
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text},
                                         "logprobs": null, "finish_reason": finish.as_str()})
                    }
                    Kind::Completion => json!({"index": 0, "text": text, "logprobs": null,
                                               "finish_reason": finish.as_str()}),
                };
                let object = match reply.kind {
                    Kind::Chat => "chat.completion",
                    Kind::Completion => "text_completion",
                };
                return Ok(Json(
                    json!({"id": reply.id, "object": object, "created": reply.created,
                    "model": reply.model(), "choices": [choice], "usage": usage}),
                )
                .into_response());
            }
            Some(Event::Failed { status, message }) => {
                reply.done(status, Usage::new(reply.n_prompt, 0));
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                return Err(ApiError::new(status, "server_error", message));
            }
            None => return Err(unavailable()),
        }
    }
}

/// Server-sent events: a chunk per text piece, the finish chunk, usage when asked, then `[DONE]`; an
/// error chunk when the request cannot finish. Dropping the stream (the client left) closes the
/// receiver, which frees the slot at the engine's next step.
fn stream(
    reply: Reply,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    enum St {
        Open { first: bool },
        Usage(Usage),
        Done,
        End,
    }
    let events = stream::unfold(
        (reply, rx, St::Open { first: true }),
        move |(reply, mut rx, state)| async move {
            let data = |v: Value| SseEvent::default().data(v.to_string());
            match state {
                St::Open { first } => match rx.recv().await {
                    Some(Event::Text(t)) => {
                        let ev = data(reply.chunk(Some(&t), first, None));
                        Some((Ok(ev), (reply, rx, St::Open { first: false })))
                    }
                    Some(Event::Done {
                        finish,
                        completion_tokens,
                    }) => {
                        let usage = Usage::new(reply.n_prompt, completion_tokens);
                        reply.done(200, usage);
                        let mut v = reply.chunk(None, first, Some(finish));
                        if first && reply.kind == Kind::Chat {
                            v["choices"][0]["delta"]["content"] = json!("");
                        }
                        let next = if include_usage {
                            St::Usage(usage)
                        } else {
                            St::Done
                        };
                        Some((Ok(data(v)), (reply, rx, next)))
                    }
                    Some(Event::Failed { status, message }) => {
                        reply.done(status, Usage::new(reply.n_prompt, 0));
                        let err = ApiError::new(
                            StatusCode::from_u16(status)
                                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                            "server_error",
                            message,
                        );
                        Some((Ok(data(err.body())), (reply, rx, St::Done)))
                    }
                    None => {
                        let err = unavailable();
                        Some((Ok(data(err.body())), (reply, rx, St::Done)))
                    }
                },
                St::Usage(u) => {
                    let ev = data(reply.usage_chunk(u));
                    Some((Ok(ev), (reply, rx, St::Done)))
                }
                St::Done => Some((Ok(SseEvent::default().data("[DONE]")), (reply, rx, St::End))),
                St::End => None,
            }
        },
    );
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
