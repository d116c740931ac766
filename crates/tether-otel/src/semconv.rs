//! The names tether-otel writes, from the OpenTelemetry GenAI semantic conventions.
//!
//! Pinned to **semantic-conventions v1.41.0** (`docs/gen-ai/gen-ai-agent-spans.md`,
//! `gen-ai-spans.md`, `gen-ai-metrics.md`, `mcp.md`), the last release holding the GenAI
//! conventions before they moved to their own repository: span names `invoke_agent {agent}`,
//! `chat {model}`, `execute_tool {tool}`; metrics `gen_ai.client.token.usage` and
//! `gen_ai.client.operation.duration`.

use serde_json::Value;

/// The semantic-conventions release these names follow.
pub const SEMCONV_VERSION: &str = "1.41.0";

/// `gen_ai.operation.name` (required on every GenAI span).
pub const OPERATION_NAME: &str = "gen_ai.operation.name";
/// `gen_ai.provider.name` (required): `openai`, `anthropic`, `aws.bedrock`, ...
pub const PROVIDER_NAME: &str = "gen_ai.provider.name";
/// `gen_ai.agent.name`.
pub const AGENT_NAME: &str = "gen_ai.agent.name";
/// `gen_ai.agent.id`.
pub const AGENT_ID: &str = "gen_ai.agent.id";
/// `gen_ai.agent.description`.
pub const AGENT_DESCRIPTION: &str = "gen_ai.agent.description";
/// `gen_ai.conversation.id`: the session's (thread's) id.
pub const CONVERSATION_ID: &str = "gen_ai.conversation.id";
/// `gen_ai.request.model`.
pub const REQUEST_MODEL: &str = "gen_ai.request.model";
/// `gen_ai.response.model`.
pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
/// `gen_ai.response.id`.
pub const RESPONSE_ID: &str = "gen_ai.response.id";
/// `gen_ai.response.finish_reasons` (string array).
pub const FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
/// `gen_ai.usage.input_tokens`.
pub const USAGE_INPUT: &str = "gen_ai.usage.input_tokens";
/// `gen_ai.usage.output_tokens`.
pub const USAGE_OUTPUT: &str = "gen_ai.usage.output_tokens";
/// `gen_ai.usage.cache_read.input_tokens`.
pub const USAGE_CACHE_READ: &str = "gen_ai.usage.cache_read.input_tokens";
/// `gen_ai.tool.name`.
pub const TOOL_NAME: &str = "gen_ai.tool.name";
/// `gen_ai.tool.call.id`.
pub const TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
/// `gen_ai.tool.type`: `function` (run by the client: tether's handler), `extension` (run by
/// the agent's side).
pub const TOOL_TYPE: &str = "gen_ai.tool.type";
/// `gen_ai.tool.description`.
pub const TOOL_DESCRIPTION: &str = "gen_ai.tool.description";
/// `error.type` (conditionally required when an operation failed).
pub const ERROR_TYPE: &str = "error.type";
/// `server.address`.
pub const SERVER_ADDRESS: &str = "server.address";
/// `server.port`.
pub const SERVER_PORT: &str = "server.port";
/// `gen_ai.token.type` (on the token usage metric): `input` or `output`.
pub const TOKEN_TYPE: &str = "gen_ai.token.type";

/// Opt-in content: `gen_ai.input.messages` (JSON string).
pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
/// Opt-in content: `gen_ai.output.messages` (JSON string).
pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
/// Opt-in content: `gen_ai.tool.call.arguments` (JSON string).
pub const TOOL_CALL_ARGUMENTS: &str = "gen_ai.tool.call.arguments";
/// Opt-in content: `gen_ai.tool.call.result`.
pub const TOOL_CALL_RESULT: &str = "gen_ai.tool.call.result";

/// MCP (`mcp.md`): `mcp.method.name`, `tools/call` on a tool call's span.
pub const MCP_METHOD_NAME: &str = "mcp.method.name";
/// MCP: `mcp.session.id`.
pub const MCP_SESSION_ID: &str = "mcp.session.id";
/// MCP: `mcp.protocol.version`.
pub const MCP_PROTOCOL_VERSION: &str = "mcp.protocol.version";
/// `network.transport` (`pipe` for stdio, `tcp` for HTTP).
pub const NETWORK_TRANSPORT: &str = "network.transport";

/// Metric: `gen_ai.client.token.usage` (histogram, `{token}`).
pub const METRIC_TOKEN_USAGE: &str = "gen_ai.client.token.usage";
/// Metric: `gen_ai.client.operation.duration` (histogram, `s`).
pub const METRIC_OPERATION_DURATION: &str = "gen_ai.client.operation.duration";
/// The conventions' bucket boundaries for token usage.
pub const TOKEN_BUCKETS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];
/// The conventions' bucket boundaries for operation duration, in seconds.
pub const DURATION_BUCKETS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// `gen_ai.provider.name` for a tether provider (its [`tether::Provider::name`]), when the
/// provider alone says who runs the model: Claude Managed Agents is `anthropic`, Bedrock
/// AgentCore `aws.bedrock`. The local loop's is its model's (`None` here: read from its model
/// calls); an ACP agent's is unknown, so the custom value `acp` names the protocol.
pub fn provider_of(tether_provider: &str) -> Option<&'static str> {
    match tether_provider {
        "managed" => Some("anthropic"),
        "agentcore" => Some("aws.bedrock"),
        "acp" => Some("acp"),
        _ => None,
    }
}

/// `error.type` for a request that ended in `error`: the HTTP status when there is one (`401`,
/// `500`), else tether's error code (`timeout`, `cancelled`, `transport`, `stream_error`,
/// `malformed_response`, ...).
pub fn error_type(error: &tether::Error) -> String {
    match error.status() {
        Some(s) => s.to_string(),
        None => error.code().to_owned(),
    }
}

/// `server.address` and `server.port` of a URL (`http://host:port/...`); the scheme's default
/// port when none is written.
pub fn server_of(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let default = match scheme {
        "https" => 443,
        "http" => 80,
        _ => return None,
    };
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        let port = after
            .strip_prefix(':')
            .and_then(|p| p.parse().ok())
            .unwrap_or(default);
        return Some((host.to_owned(), port));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Some((h.to_owned(), p.parse().ok()?)),
        None if !authority.is_empty() => Some((authority.to_owned(), default)),
        None => None,
    }
}

/// A chat history (tether's [`tether::ChatMessage`] JSON) in the conventions' input-messages
/// shape: `[{"role", "parts": [{"type": "text", "content"} | {"type": "tool_call", "id", "name",
/// "arguments"} | {"type": "tool_call_response", "id", "response"} | {"type": "reasoning",
/// "content"}]}]`.
pub fn messages(history: &Value) -> Value {
    Value::Array(
        history
            .as_array()
            .map(|a| a.iter().map(|m| message(m, None)).collect())
            .unwrap_or_default(),
    )
}

/// One tether chat message in the conventions' shape, with a finish reason for an output.
pub fn message(m: &Value, finish_reason: Option<&str>) -> Value {
    let role = m.get("role").and_then(Value::as_str).unwrap_or("assistant");
    let mut parts = Vec::new();
    if let Some(r) = m
        .get("reasoning")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
        parts.push(serde_json::json!({"type": "reasoning", "content": r}));
    }
    let content = m.get("content").and_then(Value::as_str).unwrap_or_default();
    if role == "tool" {
        parts.push(serde_json::json!({
            "type": "tool_call_response",
            "id": m.get("tool_call_id").cloned().unwrap_or(Value::Null),
            "response": content,
        }));
    } else if !content.is_empty() {
        parts.push(serde_json::json!({"type": "text", "content": content}));
    }
    for c in m
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let args = c.get("arguments").and_then(Value::as_str).unwrap_or_default();
        parts.push(serde_json::json!({
            "type": "tool_call",
            "id": c.get("id").cloned().unwrap_or(Value::Null),
            "name": c.get("name").cloned().unwrap_or(Value::Null),
            "arguments": serde_json::from_str::<Value>(args).unwrap_or_else(|_| Value::String(args.to_owned())),
        }));
    }
    let mut out = serde_json::json!({"role": role, "parts": parts});
    if let Some(f) = finish_reason {
        out["finish_reason"] = Value::String(f.to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn servers_of_urls() {
        assert_eq!(
            server_of("http://127.0.0.1:8080/v1/chat"),
            Some(("127.0.0.1".into(), 8080))
        );
        assert_eq!(
            server_of("https://api.openai.com/v1"),
            Some(("api.openai.com".into(), 443))
        );
        assert_eq!(server_of("http://[::1]:9/x"), Some(("::1".into(), 9)));
        assert_eq!(server_of("http://u:p@h/x"), Some(("h".into(), 80)));
        assert_eq!(server_of("file:///x"), None);
        assert_eq!(server_of("nonsense"), None);
    }

    #[test]
    fn error_types() {
        let http = tether::Error::Http {
            status: 401,
            message: "no".into(),
            code: None,
            retry_after: None,
            should_retry: None,
            endpoint: "http://x".into(),
        };
        assert_eq!(error_type(&http), "401");
        let timeout = tether::Error::Timeout(std::time::Duration::from_secs(1));
        assert_eq!(error_type(&timeout), "timeout");
        assert_eq!(error_type(&tether::Error::Cancelled), "cancelled");
    }

    #[test]
    fn messages_take_the_conventions_shape() {
        let h = json!([
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "name": "t", "arguments": "{\"a\":1}"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}
        ]);
        assert_eq!(
            messages(&h),
            json!([
                {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
                {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "t", "arguments": {"a": 1}}]},
                {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "ok"}]}
            ])
        );
    }
}
