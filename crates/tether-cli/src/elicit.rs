//! Elicitation at the terminal: what an MCP server (or any agent) asks the user during a tool
//! call is a question on stderr, answered on stdin, field by field.
//!
//! Everything shown comes from the server and is hostile: control characters (terminal escape
//! sequences) are removed before printing, and long texts are cut.

use std::io::{BufRead, Write};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tether::{
    Capabilities, ElicitationMode, ElicitationRequest, ElicitationResponse, Event, Handler, HandlerError,
    PermissionOutcome, PermissionRequest, ReadTextFile, SessionInfo, TerminalRequest, TerminalResponse,
    ToolOutput, ToolSpec, ToolUse, WriteTextFile,
};

/// `H` with elicitations asked at the terminal.
pub struct TerminalPrompts<H>(pub Arc<H>);

/// Removes control characters (escape sequences included) and cuts to `max` characters.
fn shown(s: &str, max: usize) -> String {
    let clean: String = s
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .filter(|c| !c.is_control())
        .collect();
    if clean.chars().count() > max {
        format!("{}…", clean.chars().take(max).collect::<String>())
    } else {
        clean
    }
}

/// One line from stdin; `None` at the end of input.
fn read_line() -> Option<String> {
    let mut line = String::new();
    match std::io::stdin().lock().read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line.trim_end_matches(['\n', '\r']).to_owned()),
    }
}

fn choices(p: &Value) -> Vec<(String, Option<String>)> {
    if let Some(e) = p.get("enum").and_then(Value::as_array) {
        let names = p.get("enumNames").and_then(Value::as_array);
        return e
            .iter()
            .enumerate()
            .filter_map(|(i, v)| {
                let title = names
                    .and_then(|n| n.get(i))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                v.as_str().map(|s| (s.to_owned(), title))
            })
            .collect();
    }
    for k in ["oneOf", "anyOf"] {
        if let Some(o) = p.get(k).and_then(Value::as_array) {
            return o
                .iter()
                .filter_map(|x| {
                    let c = x.get("const")?.as_str()?.to_owned();
                    Some((c, x.get("title").and_then(Value::as_str).map(str::to_owned)))
                })
                .collect();
        }
    }
    Vec::new()
}

/// Parses one answer for a property; `Err` says what is wrong.
fn parse(p: &Value, text: &str) -> Result<Value, String> {
    let kind = p.get("type").and_then(Value::as_str).unwrap_or("string");
    match kind {
        "boolean" => match text.to_ascii_lowercase().as_str() {
            "y" | "yes" | "true" => Ok(json!(true)),
            "n" | "no" | "false" => Ok(json!(false)),
            _ => Err("answer y or n".into()),
        },
        "integer" => text
            .parse::<i64>()
            .map(|n| json!(n))
            .map_err(|_| "a whole number".into()),
        "number" => text
            .parse::<f64>()
            .ok()
            .and_then(|n| serde_json::Number::from_f64(n).map(Value::Number))
            .ok_or_else(|| "a number".into()),
        "array" => {
            let items = p.get("items").cloned().unwrap_or(Value::Null);
            let allowed = choices(&items);
            let vals: Vec<String> = text
                .split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect();
            if !allowed.is_empty()
                && let Some(bad) = vals.iter().find(|v| !allowed.iter().any(|(c, _)| c == *v))
            {
                return Err(format!("`{}` is not one of the choices", shown(bad, 40)));
            }
            Ok(json!(vals))
        }
        _ => {
            let allowed = choices(p);
            if !allowed.is_empty() && !allowed.iter().any(|(c, _)| c == text) {
                return Err("one of the choices".into());
            }
            Ok(json!(text))
        }
    }
}

/// Asks for a form at the terminal (blocking); `Cancel` at the end of input.
fn ask_form(message: &str, schema: &Value) -> ElicitationResponse {
    let mut err = std::io::stderr();
    let _ = write!(
        err,
        "\n? the tool asks: {}\n  answer? [y]es / [N]o: ",
        shown(message, 500)
    );
    let _ = err.flush();
    match read_line().map(|l| l.trim().to_ascii_lowercase()) {
        None => return ElicitationResponse::Cancel,
        Some(l) if l == "y" || l == "yes" => {}
        Some(_) => return ElicitationResponse::Decline,
    }
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out = Map::new();
    let empty = Map::new();
    let props = schema
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    for (name, p) in props {
        let title = p.get("title").and_then(Value::as_str).unwrap_or(name);
        let mut prompt = format!("  {}", shown(title, 80));
        if let Some(d) = p.get("description").and_then(Value::as_str) {
            prompt.push_str(&format!(" ({})", shown(d, 160)));
        }
        let items = p.get("items").cloned().unwrap_or(Value::Null);
        let ch = if p.get("type").and_then(Value::as_str) == Some("array") {
            choices(&items)
        } else {
            choices(p)
        };
        if !ch.is_empty() {
            let list: Vec<String> = ch
                .iter()
                .map(|(c, t)| match t {
                    Some(t) => format!("{} = {}", shown(c, 40), shown(t, 40)),
                    None => shown(c, 40),
                })
                .collect();
            prompt.push_str(&format!(" [{}]", list.join(", ")));
        }
        let default = p.get("default");
        if let Some(d) = default {
            prompt.push_str(&format!(" default {}", shown(&d.to_string(), 60)));
        }
        let is_required = required.contains(&name.as_str());
        if is_required {
            prompt.push_str(" (required)");
        }
        loop {
            let _ = write!(err, "{prompt}: ");
            let _ = err.flush();
            let Some(line) = read_line() else {
                return ElicitationResponse::Cancel;
            };
            let line = line.trim();
            if line.is_empty() {
                if let Some(d) = default {
                    out.insert(name.clone(), d.clone());
                    break;
                }
                if !is_required {
                    break;
                }
                let _ = writeln!(err, "  (required)");
                continue;
            }
            match parse(p, line) {
                Ok(v) => {
                    out.insert(name.clone(), v);
                    break;
                }
                Err(why) => {
                    let _ = writeln!(err, "  ({why})");
                }
            }
        }
    }
    ElicitationResponse::Accept {
        content: Some(Value::Object(out)),
    }
}

fn ask_url(message: &str, url: &str) -> ElicitationResponse {
    let mut err = std::io::stderr();
    let _ = write!(
        err,
        "\n? the tool asks you to visit {}\n  {}\n  done? [y]es / [N]o: ",
        shown(url, 500),
        shown(message, 500)
    );
    let _ = err.flush();
    match read_line().map(|l| l.trim().to_ascii_lowercase()) {
        None => ElicitationResponse::Cancel,
        Some(l) if l == "y" || l == "yes" => ElicitationResponse::Accept { content: None },
        Some(_) => ElicitationResponse::Decline,
    }
}

#[async_trait]
impl<H: Handler> Handler for TerminalPrompts<H> {
    async fn elicit(&self, req: &ElicitationRequest, _info: &SessionInfo) -> ElicitationResponse {
        let req = req.clone();
        tokio::task::spawn_blocking(move || match &req.mode {
            ElicitationMode::Form { schema } => ask_form(&req.message, schema),
            ElicitationMode::Url { url } => ask_url(&req.message, url),
            _ => ElicitationResponse::Decline,
        })
        .await
        .unwrap_or(ElicitationResponse::Cancel)
    }
    fn tools(&self) -> Vec<ToolSpec> {
        self.0.tools()
    }
    fn tools_version(&self) -> Option<u64> {
        self.0.tools_version()
    }
    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        self.0.call_tool(call, info).await
    }
    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        self.0.on_event(event, info).await
    }
    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        self.0.request_permission(req, info).await
    }
    async fn read_text_file(&self, req: &ReadTextFile, info: &SessionInfo) -> Result<String, HandlerError> {
        self.0.read_text_file(req, info).await
    }
    async fn write_text_file(&self, req: &WriteTextFile, info: &SessionInfo) -> Result<(), HandlerError> {
        self.0.write_text_file(req, info).await
    }
    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> Result<TerminalResponse, HandlerError> {
        self.0.terminal(req, info).await
    }
    async fn elicitation_complete(&self, id: &str, info: &SessionInfo) {
        self.0.elicitation_complete(id, info).await
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities().with_elicitation(true, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_text_loses_its_escapes() {
        assert_eq!(shown("a\u{1b}[2Jb\nc", 100), "a[2Jb c");
        assert_eq!(shown("abcdef", 3), "abc…");
    }

    #[test]
    fn answers_are_typed() {
        assert_eq!(parse(&json!({"type": "integer"}), "42"), Ok(json!(42)));
        assert!(parse(&json!({"type": "integer"}), "4.5").is_err());
        assert_eq!(parse(&json!({"type": "boolean"}), "y"), Ok(json!(true)));
        assert_eq!(
            parse(&json!({"type": "string", "enum": ["a", "b"]}), "b"),
            Ok(json!("b"))
        );
        assert!(parse(&json!({"type": "string", "enum": ["a", "b"]}), "c").is_err());
        assert_eq!(
            parse(&json!({"type": "array", "items": {"enum": ["x", "y"]}}), "x, y"),
            Ok(json!(["x", "y"]))
        );
    }
}
