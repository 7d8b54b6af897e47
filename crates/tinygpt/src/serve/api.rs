//! OpenAI's wire format: the request bodies we accept, the response and chunk objects we send, and
//! errors as OpenAI shapes them (`{"error": {"message", "type", "param", "code"}}`), so the `openai`
//! client and the tools built on it read our errors as theirs.

use axum::Json;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// An error a client gets, in OpenAI's format.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, not_found_error, server_error, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            code: Some("unsupported_parameter"),
            ..Self::bad_request(Some(param), message)
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body, also used for an error chunk ending a stream.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// A JSON body (413 in OpenAI's format past the body limit, 400 when it is not JSON). Its fields are
/// read with [`parse`], which names the one that is wrong.
pub struct JsonBody(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| {
                let status = e.status();
                let err = ApiError::new(status, "invalid_request_error", e.body_text());
                if status == StatusCode::PAYLOAD_TOO_LARGE {
                    err.with_code("request_too_large")
                } else {
                    err
                }
            })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::bad_request(None, format!("the body is not valid JSON: {e}")))
    }
}

/// Reads `T` out of a JSON body; a wrong field is a 400 naming it (`messages[0].content: ...`).
pub fn parse<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != "." && !path.is_empty()).then_some(path.as_str());
        let what = match param {
            Some(p) => format!("{p}: {inner}"),
            None => inner.to_string(),
        };
        ApiError::bad_request(param, what)
    })
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Parameters both endpoints share (OpenAI's names; `top_k` and `min_tokens`-free llama.cpp style).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// The newer name of `max_tokens` on the chat endpoint.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub echo: Option<bool>,
    /// llama.cpp's extension: generate through end-of-generation tokens (benchmarks, load tests).
    #[serde(default)]
    pub ignore_eos: bool,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

/// One chat message. `content` is a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of text parts")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Content, E> {
                Ok(Content::Text(s.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
                Vec::<Part>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(Content::Parts)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/chat/completions` (with the [`Sampling`] fields beside).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
}

/// `prompt`: a string, or a list holding one string.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
}

/// `POST /v1/completions` (with the [`Sampling`] fields beside).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
}

/// `POST /tokenize` (llama.cpp's server format).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<i64>,
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}
