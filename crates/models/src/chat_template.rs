//! Chat templates: the Jinja template a GGUF file carries in `tokenizer.chat_template`, rendered the
//! way Hugging Face transformers' `apply_chat_template` renders it.
//!
//! transformers renders with Jinja2 with `trim_blocks` and `lstrip_blocks` on, the `loopcontrols`
//! extension, and the globals `raise_exception` and `strftime_now`; templates also call Python string
//! methods (`content.strip()`, `role.startswith(..)`). MiniJinja with the same whitespace settings,
//! loop controls, `tojson`, and minijinja-contrib's Python-compatible methods covers that.
//!
//! Files without a template (Gemma 3 270M is a base model and has none) can use a built-in format
//! written to produce exactly what llama.cpp's `llama_chat_apply_template` produces for it
//! ([`ChatTemplate::builtin`]).

#[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed: {0}")]
    Render(String),
    #[error("unknown built-in chat template {0:?} (known: chatml, gemma)")]
    UnknownBuiltin(String),
}

/// llama.cpp's "chatml" format: every message as `<|im_start|>role\ncontent<|im_end|>\n`.
const CHATML: &str = "{%- for message in messages -%}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

/// llama.cpp's "gemma" format: "assistant" is "model", system messages are merged into the next
/// user turn, contents are trimmed.
const GEMMA: &str = "{%- set ns = namespace(system='') -%}\
{%- for message in messages -%}\
{%- if message['role'] == 'system' -%}\
{%- set ns.system = ns.system + (message['content'] | trim) -%}\
{%- else -%}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
{{ '<start_of_turn>' + role + '\\n' }}\
{%- if ns.system and role != 'model' -%}{{ ns.system + '\\n\\n' }}{%- set ns.system = '' -%}{%- endif -%}\
{{ (message['content'] | trim) + '<end_of_turn>\\n' }}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

const TEMPLATE_NAME: &str = "chat";

/// Template instructions one render may run (a real template spends tens per message).
const TEMPLATE_FUEL: u64 = 2_000_000;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles a Jinja chat template (as found in `tokenizer.chat_template`).
    pub fn new(source: &str) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        // Templates come inside model files: bound the work one render may do, so a template that
        // loops for ever (or nearly) is an error, not a hung chat or server.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatTemplateError::Compile(describe(&e)))?;
        Ok(ChatTemplate { env })
    }

    /// A built-in format for files without a template: `chatml` or `gemma`, matching llama.cpp's
    /// built-in templates of those names.
    pub fn builtin(name: &str) -> Result<Self, ChatTemplateError> {
        match name {
            "chatml" => ChatTemplate::new(CHATML),
            "gemma" => ChatTemplate::new(GEMMA),
            other => Err(ChatTemplateError::UnknownBuiltin(other.to_string())),
        }
    }

    /// Renders `messages` (role, content) as the prompt text. With `add_generation_prompt`, the
    /// text ends with the opening of the assistant's turn. `bos_token` / `eos_token` are the texts the
    /// template may insert (transformers passes the tokenizer's).
    pub fn render(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatTemplateError> {
        let messages: Vec<Value> = messages
            .iter()
            // Keys in transformers' order, so `tojson` of a message prints the same text.
            .map(|&(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        template
            .render(ctx)
            .map_err(|e| ChatTemplateError::Render(describe(&e)))
    }
}

impl ChatTemplate {
    /// Fixes the time `strftime_now` reports (Unix seconds, UTC), for reproducible prompts and for
    /// targets without a clock.
    pub fn with_time(mut self, unix_secs: i64) -> Self {
        self.env
            .add_function("strftime_now", move |format: String| {
                format_time(&format, unix_secs)
            });
        self
    }
}

/// One-shot [`ChatTemplate::new`] + [`ChatTemplate::render`].
pub fn render(
    template: &str,
    messages: &[(&str, &str)],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ChatTemplateError> {
    ChatTemplate::new(template)?.render(messages, add_generation_prompt, bos_token, eos_token)
}

/// The message and, where MiniJinja knows it, the template line.
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{e} (line {line})"),
        None => e.to_string(),
    }
}

/// Templates call `raise_exception('...')` to reject conversations they cannot format.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, as Python's `datetime.now().strftime` (templates use
/// it to put today's date in a system prompt).
fn strftime_now(format: String) -> String {
    format_time(&format, now_unix_secs())
}

#[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
fn now_unix_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The browser target has no std clock (`SystemTime::now` panics there): report the epoch unless
/// [`ChatTemplate::with_time`] gives the time.
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
fn now_unix_secs() -> i64 {
    0
}

/// `strftime` for a Unix time (UTC), covering the common directives; others are kept verbatim.
fn format_time(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian (H. Hinnant's
/// algorithm).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::Value as Json;

    use super::*;
    use crate::tokenizer::Tokenizer;

    fn data(name: &str) -> Json {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/chat_template")
            .join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn messages(case: &Json) -> Vec<(String, String)> {
        case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().to_string(),
                    m["content"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    fn render_case(template: &ChatTemplate, case: &Json, bos: &str, eos: &str) -> String {
        let owned = messages(case);
        let borrowed: Vec<(&str, &str)> = owned
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        template.render(&borrowed, add, bos, eos).unwrap()
    }

    fn models_dir() -> PathBuf {
        match std::env::var_os("TINYGPT_MODELS_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/models"),
        }
    }

    /// SmolLM2's own template, taken from its GGUF file, renders exactly as transformers'
    /// `apply_chat_template`, and the result tokenizes to llama.cpp's ids.
    #[test]
    fn smollm2_template_matches_transformers() {
        let path = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.exists(),
            "{} is missing: run scripts/fetch-models.sh (or set TINYGPT_MODELS_DIR)",
            path.display()
        );
        let gguf = tinygpt_formats::GgufFile::open(&path).unwrap();
        let tokenizer = Tokenizer::from_gguf(gguf.metadata()).unwrap();
        let source = tokenizer
            .chat_template()
            .expect("SmolLM2 carries a chat template");
        let reference = data("smollm2_transformers.json");
        assert_eq!(source, reference["template"].as_str().unwrap());
        let template = ChatTemplate::new(source).unwrap();
        let bos = reference["bos_token"].as_str().unwrap_or("");
        let eos = reference["eos_token"].as_str().unwrap_or("");

        let ids = data("llamacpp_builtin.json");
        let ids = ids["smollm2_transformers_rendering_ids"]
            .as_array()
            .unwrap();
        let cases = reference["cases"].as_array().unwrap();
        assert_eq!(cases.len(), ids.len());
        for (case, want) in cases.iter().zip(ids) {
            let rendered = render_case(&template, case, bos, eos);
            assert_eq!(
                rendered,
                case["rendered"].as_str().unwrap(),
                "{}",
                case["name"]
            );
            let want: Vec<u32> = want["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tokenizer.encode(&rendered, true), want, "{}", case["name"]);
        }
    }

    #[test]
    fn builtin_templates_match_llamacpp() {
        let reference = data("llamacpp_builtin.json");
        for case in reference["cases"].as_array().unwrap() {
            let name = case["template"].as_str().unwrap();
            let template = ChatTemplate::builtin(name).unwrap();
            assert_eq!(
                render_case(&template, case, "", ""),
                case["rendered"].as_str().unwrap(),
                "{name} {}",
                case["name"]
            );
        }
    }

    #[test]
    fn hf_template_features() {
        let source = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\
            {% if loop.index > 2 %}{% break %}{% endif %}{{ m['content'].strip() | upper }}|{% endfor %}\
            {{ messages[0] | tojson }}{{ bos_token }}";
        let t = ChatTemplate::new(source).unwrap();
        let out = t
            .render(
                &[("user", " a "), ("assistant", "b"), ("user", "c")],
                false,
                "<s>",
                "</s>",
            )
            .unwrap();
        // `tojson` spaces its output like Python's json.dumps, as transformers' filter does.
        assert_eq!(out, r#"A|B|{"role": "user", "content": " a "}<s>"#);
        let err = t.render(&[("tool", "x")], false, "", "").unwrap_err();
        assert!(err.to_string().contains("no tools"), "{err}");
        assert!(matches!(
            ChatTemplate::new("{% for %}"),
            Err(ChatTemplateError::Compile(_))
        ));
        assert!(matches!(
            ChatTemplate::builtin("nope"),
            Err(ChatTemplateError::UnknownBuiltin(_))
        ));
    }

    #[test]
    fn strftime_covers_common_directives() {
        // 2026-11-29 12:34:56 UTC, a Sunday.
        let t = 1_795_955_696;
        assert_eq!(format_time("%Y-%m-%d %H:%M:%S", t), "2026-11-29 12:34:56");
        assert_eq!(
            format_time("%d %b %Y, %A (%a) %B %j %I%p %%", t),
            "29 Nov 2026, Sunday (Sun) November 333 12PM %"
        );
        assert_eq!(format_time("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(format_time("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert!(strftime_now("%Y".into()).len() == 4);
        let fixed = ChatTemplate::new("{{ strftime_now('%d %B %Y') }}")
            .unwrap()
            .with_time(t);
        assert_eq!(
            fixed.render(&[], false, "", "").unwrap(),
            "29 November 2026"
        );
    }
}
