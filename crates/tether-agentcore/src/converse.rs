//! Folding a turn's Converse-shaped stream events, keyed by `toolUseId` (live streams have
//! been seen reusing one `contentBlockIndex` for two tool uses, so index keys would merge them).

use std::collections::HashMap;

use serde_json::{Value, json};
use tether::{Terminal, ToolUse, Usage};

/// One tool use being assembled.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ToolBlock {
    /// `toolUseId`.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The concatenated input fragments.
    pub input: String,
    /// `type` (`tool_use`, `server_tool_use`, `mcp_tool_use`); server-side ones are observed only.
    pub kind: String,
}

impl ToolBlock {
    /// Whether the harness runs this tool itself.
    pub fn is_server(&self) -> bool {
        matches!(self.kind.as_str(), "server_tool_use" | "mcp_tool_use")
    }
}

/// The fold of one turn.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Fold {
    /// Assistant text.
    pub text: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Tool uses in first-seen order.
    pub tools: Vec<ToolBlock>,
    active: HashMap<u64, String>,
    /// Where each id is in `tools` (a lookup that stays cheap however many tool uses a stream
    /// brings).
    tool_ids: HashMap<String, usize>,
    /// Bytes kept from the model (see [`Fold::kept`]).
    kept: usize,
    role: Option<String>,
    open: bool,
    /// The last `messageStop.stopReason`.
    pub stop_reason: Option<String>,
    /// Usage from `metadata`.
    pub usage: Option<Usage>,
}

impl Fold {
    /// Folds one `{eventType: payload}` pair; returns assistant text it added (for live deltas).
    pub fn apply(&mut self, event_type: &str, p: &Value) -> Option<String> {
        match event_type {
            "messageStart" => {
                self.role = p["role"].as_str().map(str::to_owned);
                self.open = true;
                self.stop_reason = None;
            }
            "contentBlockStart" => {
                let idx = p["contentBlockIndex"].as_u64().unwrap_or(0);
                let tu = &p["start"]["toolUse"];
                if let Some(id) = tu["toolUseId"].as_str() {
                    if !self.tool_ids.contains_key(id) {
                        self.tool_ids.insert(id.to_owned(), self.tools.len());
                        let name = tu["name"].as_str().unwrap_or_default().to_owned();
                        self.kept += id.len() + name.len();
                        self.tools.push(ToolBlock {
                            id: id.to_owned(),
                            name,
                            input: String::new(),
                            kind: tu["type"].as_str().unwrap_or("tool_use").to_owned(),
                        });
                    }
                    self.active.insert(idx, id.to_owned());
                }
            }
            "contentBlockDelta" => {
                let idx = p["contentBlockIndex"].as_u64().unwrap_or(0);
                let d = &p["delta"];
                if let Some(t) = d["text"].as_str() {
                    if self.role.as_deref().unwrap_or("assistant") == "assistant" {
                        self.text.push_str(t);
                        self.kept += t.len();
                        return Some(t.to_owned());
                    }
                } else if let Some(frag) = d["toolUse"]["input"].as_str() {
                    if let Some(id) = self.active.get(&idx)
                        && let Some(&at) = self.tool_ids.get(id)
                        && let Some(t) = self.tools.get_mut(at)
                    {
                        t.input.push_str(frag);
                        self.kept += frag.len();
                    }
                } else if let Some(r) = d["reasoningContent"]["text"].as_str() {
                    self.reasoning.push_str(r);
                    self.kept += r.len();
                }
            }
            "contentBlockStop" => {
                let idx = p["contentBlockIndex"].as_u64().unwrap_or(0);
                self.active.remove(&idx);
            }
            "messageStop" => {
                self.open = false;
                self.stop_reason = p["stopReason"].as_str().map(str::to_owned);
            }
            "metadata" => {
                let u = &p["usage"];
                if u.is_object() {
                    let n = |k: &str| u[k].as_u64().unwrap_or(0);
                    self.usage = Some(
                        Usage::new(n("inputTokens"), n("outputTokens"))
                            .with_cache_read_tokens(n("cacheReadInputTokens"))
                            .with_raw(u.clone()),
                    );
                }
            }
            _ => {}
        }
        None
    }

    /// Bytes the fold keeps from the model: text, reasoning, and every tool use's id, name and
    /// input (what a response cap bounds).
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Whether the stream reached a final `messageStop` with a stop reason.
    pub fn is_complete(&self) -> bool {
        !self.open && self.stop_reason.is_some()
    }

    /// The custom (locally run) tool uses, inputs decoded (invalid JSON keeps its parse error).
    pub fn tool_uses(&self) -> Vec<ToolUse> {
        self.tools
            .iter()
            .filter(|t| !t.is_server())
            .map(|t| ToolUse::from_arguments(&t.id, &t.name, &t.input))
            .collect()
    }

    /// The tool uses the harness ran itself.
    pub fn server_tool_uses(&self) -> Vec<ToolUse> {
        self.tools
            .iter()
            .filter(|t| t.is_server())
            .map(|t| ToolUse::from_arguments(&t.id, &t.name, &t.input))
            .collect()
    }

    /// The terminal: `end_turn` / `stop_sequence` → `EndTurn`; `tool_use` with local tools →
    /// `RequiresAction`; anything else → `Terminated`.
    pub fn terminal(&self) -> Terminal {
        match self.stop_reason.as_deref() {
            Some("end_turn" | "stop_sequence") => Terminal::EndTurn,
            Some("tool_use") if !self.tool_uses().is_empty() => Terminal::RequiresAction,
            _ => Terminal::Terminated,
        }
    }

    /// The assistant message to send back in a resume: text, then each local tool use.
    pub fn assistant_message(&self) -> Value {
        let mut content = Vec::new();
        if !self.text.is_empty() {
            content.push(json!({"text": self.text}));
        }
        for u in self.tool_uses() {
            let input = if u.input.is_object() {
                u.input.clone()
            } else {
                json!({})
            };
            content.push(json!({"toolUse": {"toolUseId": u.id, "name": u.name, "input": input}}));
        }
        json!({"role": "assistant", "content": content})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_block_index_keeps_two_tool_uses_apart() {
        let mut f = Fold::default();
        let start = |id: &str| json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": id, "name": "lookup"}}});
        let delta = |s: &str| json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": s}}});
        f.apply("messageStart", &json!({"role": "assistant"}));
        f.apply("contentBlockStart", &start("a"));
        f.apply("contentBlockDelta", &delta("{\"q\":"));
        f.apply("contentBlockDelta", &delta("1}"));
        f.apply("contentBlockStop", &json!({"contentBlockIndex": 1}));
        f.apply("contentBlockStart", &start("b"));
        f.apply("contentBlockDelta", &delta("{\"q\":2}"));
        f.apply("contentBlockStop", &json!({"contentBlockIndex": 1}));
        f.apply("messageStop", &json!({"stopReason": "tool_use"}));
        let uses = f.tool_uses();
        assert_eq!(uses.len(), 2);
        assert_eq!(uses[0].input, json!({"q": 1}));
        assert_eq!(uses[1].input, json!({"q": 2}));
        assert_eq!(f.terminal(), Terminal::RequiresAction);
        assert!(f.is_complete());
    }
}
