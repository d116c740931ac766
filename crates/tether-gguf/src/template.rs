//! The chat template: `tokenizer.chat_template` from the GGUF, rendered with `minijinja` the way
//! Hugging Face's `apply_chat_template` renders it with Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! Python string methods through `minijinja-contrib`'s pycompat, `tojson` as Python's
//! `json.dumps`, `raise_exception`, `strftime_now`).
//!
//! Tools go to the template when it takes them (its source mentions `tools`, as Qwen's do).
//! Otherwise (SmolLM2's template knows nothing of tools) tether writes the documented tool prompt
//! ([`tool_prompt`]) into the system message, writes an assistant's tool calls into its content
//! as `<tool_call>` blocks, and hands tool results back as user messages in `<tool_response>`
//! blocks: the format Qwen 2.5 and Hermes models are trained on.
//!
//! Every piece of text that came from a message or a tool definition is wrapped in
//! [`crate::tokenizer::UNTRUSTED_OPEN`] / [`crate::tokenizer::UNTRUSTED_CLOSE`] so the tokenizer
//! never reads a control token out of it.

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value, json};
use tether::event::Role;
use tether::{ChatMessage, ToolSpec};

use crate::error::GgufError;
use crate::tokenizer::{UNTRUSTED_CLOSE, UNTRUSTED_OPEN, sanitize};

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    takes_tools: bool,
    takes_tool_role: bool,
    takes_tool_calls: bool,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("takes_tools", &self.takes_tools)
            .finish()
    }
}

/// ChatML, for a GGUF without a template.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn wrap(s: &str) -> String {
    let s = sanitize(s);
    let mut out = String::with_capacity(s.len() + 6);
    out.push(UNTRUSTED_OPEN);
    out.push_str(&s);
    out.push(UNTRUSTED_CLOSE);
    out
}

/// Wraps every string inside a JSON value (keys stay as they are: they are matched by schemas).
fn wrap_strings(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::String(wrap(s)),
        Value::Array(a) => Value::Array(a.iter().map(wrap_strings).collect()),
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), wrap_strings(v))).collect()),
        other => other.clone(),
    }
}

/// Python's `json.dumps(v, ensure_ascii=False)` (separators `", "` and `": "`), or with `indent`.
pub fn py_json(v: &Value, indent: Option<usize>) -> String {
    fn go(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
        let nl = |out: &mut String, level: usize| {
            if let Some(n) = indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * level));
            }
        };
        let item_sep = if indent.is_some() { "," } else { ", " };
        match v {
            Value::Array(a) if !a.is_empty() => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    nl(out, level + 1);
                    go(x, indent, level + 1, out);
                }
                nl(out, level);
                out.push(']');
            }
            Value::Object(m) if !m.is_empty() => {
                out.push('{');
                for (i, (k, x)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    nl(out, level + 1);
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push_str(": ");
                    go(x, indent, level + 1, out);
                }
                nl(out, level);
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    go(v, indent, 0, &mut out);
    out
}

fn tojson(v: JValue, kwargs: Kwargs) -> Result<String, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let j: Value = serde_json::to_value(&v)
        .map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(py_json(&j, indent))
}

fn raise_exception(msg: String) -> Result<String, JError> {
    Err(JError::new(
        ErrorKind::InvalidOperation,
        format!("the template raised: {msg}"),
    ))
}

fn strftime_now(fmt: String) -> String {
    // No clock formatting crate in the build: render the date parts templates ask for in UTC.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
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
    let month = MONTHS
        .get((m as usize).saturating_sub(1))
        .copied()
        .unwrap_or("January");
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%B", month)
        .replace("%b", &month[..3])
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (era * 400 + yoe + i64::from(m <= 2), m, d)
}

/// The tool prompt written into the system message for templates that do not take tools.
pub fn tool_prompt(tools: &[ToolSpec]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&wrap(&py_json(&tool_json(t), None)));
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

fn tool_json(t: &ToolSpec) -> Value {
    json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}})
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
        _ => "user",
    }
}

/// A tool call written as the block the model is asked to produce.
pub fn call_block(name: &str, arguments: &str) -> String {
    let args: Value = serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_owned()));
    let body = py_json(&json!({"name": name, "arguments": args}), None);
    format!("<tool_call>\n{body}\n</tool_call>")
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template). `bos`/`eos` are the token texts templates use.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, GgufError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| GgufError::Template(format!("the template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            takes_tools: source.contains("tools"),
            takes_tool_role: source.contains("tool"),
            takes_tool_calls: source.contains("tool_calls"),
            bos: bos.to_owned(),
            eos: eos.to_owned(),
        })
    }

    /// Whether the template renders the tool list itself.
    pub fn takes_tools(&self) -> bool {
        self.takes_tools
    }

    /// Renders `messages` with `tools`, ending with the assistant's generation prompt. Message
    /// text is wrapped in untrusted-text markers (see [`crate::tokenizer::Tokenizer::encode_marked`]).
    pub fn render(&self, messages: &[ChatMessage], tools: &[ToolSpec]) -> Result<String, GgufError> {
        let mut msgs: Vec<Value> = Vec::with_capacity(messages.len() + 1);
        let native = self.takes_tools;
        for m in messages {
            let mut o = Map::new();
            let mut role = role_name(m.role);
            let content = m.content.clone().unwrap_or_default();
            if m.role == Role::Tool && !(native && self.takes_tool_role) {
                // Results in the documented format, as a user turn; consecutive results join.
                role = "user";
                let block = format!("<tool_response>\n{}\n</tool_response>", wrap(&content));
                if let Some(prev) = msgs.last_mut()
                    && prev.get("__tool_results").is_some()
                    && let Some(Value::String(c)) = prev.get_mut("content")
                {
                    c.push('\n');
                    c.push_str(&block);
                    continue;
                }
                o.insert("__tool_results".into(), Value::Bool(true));
                o.insert("role".into(), role.into());
                o.insert("content".into(), Value::String(block));
                msgs.push(Value::Object(o));
                continue;
            }
            let mut content = wrap(&content);
            if m.role == Role::Assistant && !m.tool_calls.is_empty() {
                if native && self.takes_tool_calls {
                    let calls: Vec<Value> = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            let args: Value = serde_json::from_str(&c.arguments)
                                .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                            json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": wrap_strings(&args)}})
                        })
                        .collect();
                    o.insert("tool_calls".into(), Value::Array(calls));
                } else {
                    for c in &m.tool_calls {
                        if !content.is_empty() && content != wrap("") {
                            content.push('\n');
                        }
                        content.push_str(&wrap(&call_block(&c.name, &c.arguments)));
                    }
                }
            }
            if m.role == Role::Tool
                && let Some(id) = &m.tool_call_id
            {
                o.insert("tool_call_id".into(), Value::String(id.clone()));
            }
            o.insert("role".into(), role.into());
            o.insert("content".into(), Value::String(content));
            msgs.push(Value::Object(o));
        }
        for m in &mut msgs {
            if let Value::Object(o) = m {
                o.remove("__tool_results");
            }
        }
        if !tools.is_empty() && !native {
            let prompt = tool_prompt(tools);
            match msgs.first_mut() {
                Some(Value::Object(o)) if o.get("role") == Some(&Value::String("system".into())) => {
                    if let Some(Value::String(c)) = o.get_mut("content") {
                        c.push_str("\n\n");
                        c.push_str(&prompt);
                    }
                }
                _ => msgs.insert(0, json!({"role": "system", "content": prompt})),
            }
        }
        let tools_v: Vec<Value> = tools.iter().map(|t| wrap_strings(&tool_json(t))).collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| GgufError::Template(e.to_string()))?;
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Value::Array(msgs));
        if native && !tools.is_empty() {
            ctx.insert("tools".into(), Value::Array(tools_v));
        }
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        ctx.insert("bos_token".into(), Value::String(self.bos.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos.clone()));
        tmpl.render(JValue::from_serialize(Value::Object(ctx)))
            .map_err(|e| GgufError::Template(format!("{e:#}")))
    }

    /// Renders a context given as JSON (`messages`, `add_generation_prompt`, ...) with no
    /// markers and no tool handling: what Jinja2 would render, for golden tests.
    pub fn render_raw(&self, ctx: &Value) -> Result<String, GgufError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| GgufError::Template(e.to_string()))?;
        let mut ctx = ctx.clone();
        if let Value::Object(o) = &mut ctx {
            o.entry("bos_token")
                .or_insert_with(|| Value::String(self.bos.clone()));
            o.entry("eos_token")
                .or_insert_with(|| Value::String(self.eos.clone()));
        }
        tmpl.render(JValue::from_serialize(&ctx))
            .map_err(|e| GgufError::Template(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_separators() {
        let v = json!({"a": [1, "x"], "b": {}});
        assert_eq!(py_json(&v, None), r#"{"a": [1, "x"], "b": {}}"#);
        assert_eq!(
            py_json(&v, Some(2)),
            "{\n  \"a\": [\n    1,\n    \"x\"\n  ],\n  \"b\": {}\n}"
        );
        assert_eq!(py_json(&json!("é<"), None), "\"é<\"");
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    }
}
