//! How a session's events are shown on the terminal, for every provider and subcommand
//! (`tether run`, `tether acp`): one [`Printer`], inert text (see [`crate::term`]).
//!
//! Text mode: assistant text streams as prose; a tool call is one `⚙ name input` line, shown once
//! (a streamed call when its arguments are complete, a call a remote loop announces whole, such
//! as an ACP agent's `tool_call`, at once); a result is one `✓`/`✗` line; a retry notice goes to
//! stderr. `--json` mode: every event as one `{"event": …}` line.

use std::collections::{HashMap, HashSet};
use std::io::Write;

use serde_json::json;
use tether::{Event, EventKind, SessionResult};

use crate::term::{Inert, inert, inert_json};

/// One line of at most `n` characters of `s` (then `…`), escaped.
pub fn short(s: &str, n: usize) -> String {
    let cut = match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    };
    let mut line = inert(cut, Inert::Line).into_owned();
    if cut.len() < s.len() {
        line.push('…');
    }
    line
}

/// A request's result as one `{"result": …}` JSON line (`--json`), without its events (already
/// printed one by one) and the provider's transcript.
pub fn result_line(r: &SessionResult) -> String {
    let mut v = serde_json::to_value(r).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.remove("events");
        o.remove("transcript");
    }
    inert_json(&json!({"result": v}).to_string()).into_owned()
}

/// Shown when a retried model call said something else than what was printed of it.
const RESTARTED: &str = "[retried: the answer starts over]";

/// Prints a session's events on stdout, keeping track of where the cursor is (mid-line or at
/// the start of one) so status lines never run into streamed text.
pub struct Printer {
    json: bool,
    at_line_start: bool,
    /// Tool calls whose arguments are streaming: name and arguments so far.
    streaming: HashMap<String, (String, String)>,
    /// Tool calls already shown.
    shown: HashSet<String>,
}

impl Printer {
    /// A printer for text (`json == false`) or JSON lines.
    pub fn new(json: bool) -> Self {
        Printer {
            json,
            at_line_start: true,
            streaming: HashMap::new(),
            shown: HashSet::new(),
        }
    }

    /// Forgets the tool calls of the last request (call ids are only unique within one).
    pub fn next_request(&mut self) {
        self.streaming.clear();
        self.shown.clear();
    }

    /// Whether the cursor is at the start of a line.
    pub fn at_line_start(&self) -> bool {
        self.at_line_start
    }

    /// Ends the current line if text left the cursor in the middle of one.
    pub fn end_line(&mut self) {
        if !self.at_line_start {
            println!();
            self.at_line_start = true;
        }
    }

    /// Prints one status line of ours (which may quote outside text: printed inert) on stdout,
    /// on a line of its own.
    pub fn line(&mut self, s: &str) {
        self.end_line();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", inert(s, Inert::Line));
        let _ = out.flush();
    }

    /// Shows one event.
    pub fn event(&mut self, e: &Event) {
        if self.json {
            if let Ok(s) = serde_json::to_string(&json!({"event": e})) {
                println!("{}", inert_json(&s));
            }
            return;
        }
        match &e.kind {
            // Calls the restarted message was streaming are void; it streams them again.
            EventKind::MessageRestart { .. } => {
                self.streaming.clear();
                self.restart();
            }
            // A recorded start announces a call whole (a remote loop's, e.g. an ACP agent's
            // `tool_call`): no arguments stream after it. Recorded once, so shown whenever seen
            // (an agent may use the same id again in a later turn).
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } if e.is_durable() => {
                self.shown.insert(tool_use_id.clone());
                self.call(name, "");
            }
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } => {
                self.streaming
                    .insert(tool_use_id.clone(), (name.clone(), String::new()));
            }
            EventKind::ToolCallArgs { tool_use_id, delta } => {
                if let Some((_, a)) = self.streaming.get_mut(tool_use_id) {
                    a.push_str(delta);
                }
            }
            EventKind::ToolCallEnd { tool_use_id } => {
                if let Some((name, args)) = self.streaming.remove(tool_use_id) {
                    self.shown.insert(tool_use_id.clone());
                    let input = tether::ToolUse::from_arguments(tool_use_id, &name, &args);
                    self.call(&input.name, &input.input.to_string());
                }
            }
            EventKind::ToolCall { tool_use, .. } if self.shown.insert(tool_use.id.clone()) => {
                self.call(&tool_use.name, &tool_use.input.to_string());
            }
            EventKind::ToolResult { result } => {
                // A call whose start was seen but never completed is shown before its result.
                if let Some((name, args)) = self.streaming.remove(&result.tool_use_id)
                    && self.shown.insert(result.tool_use_id.clone())
                {
                    self.call(&name, &args);
                }
                let mark = if result.is_error { "✗" } else { "✓" };
                self.end_line();
                println!("{mark} {}", short(&result.content, 160));
            }
            EventKind::Message { tool_uses, .. } => {
                for u in tool_uses {
                    if self.shown.insert(u.id.clone()) {
                        self.call(&u.name, &u.input.to_string());
                    }
                }
            }
            EventKind::TextDelta { delta, .. } => {
                let mut out = std::io::stdout().lock();
                let _ = write!(out, "{}", inert(delta, Inert::Prose));
                let _ = out.flush();
                if !delta.is_empty() {
                    self.at_line_start = delta.ends_with('\n');
                }
            }
            EventKind::Retry {
                attempt,
                delay_ms,
                error,
            } => {
                eprintln!("\n(retry {attempt} in {delay_ms} ms: {})", short(error, 300));
            }
            _ => {}
        }
    }

    fn restart(&mut self) {
        self.end_line();
        println!("{RESTARTED}");
        let _ = std::io::stdout().flush();
    }

    fn call(&mut self, name: &str, input: &str) {
        self.end_line();
        if input.is_empty() {
            println!("⚙ {}", short(name, 80));
        } else {
            println!("⚙ {} {}", short(name, 80), short(input, 120));
        }
        let _ = std::io::stdout().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_are_one_escaped_line() {
        assert_eq!(short("a\nb\x1b[2Jc", 160), "a\\nb\\x1b[2Jc");
        assert_eq!(short("ééééé", 3), "ééé…");
    }
}
