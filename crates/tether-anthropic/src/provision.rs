//! Provisioning of Managed Agents resources: create (or find) an agent and an environment from a
//! spec, rolling back what this call created when a later step fails.
//!
//! Names are content-addressed: `<name>_<digest8>`, where the digest is 8 lowercase hex digits of
//! a 64-bit FNV-1a hash over the canonical JSON (keys sorted, no whitespace) of the spec without
//! its name. A create answered with 409 is recovered by listing and adopting the live resource of
//! exactly that name; an archived one is an error.

use reqwest::Method;
use serde_json::{Map, Value, json};
use tether::{Error, ToolSpec};

use crate::http::{ApiClient, ClientConfig};
use crate::managed::MANAGED_AGENTS_BETA;

/// What to provision.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AgentSpec {
    /// The base name (a digest is appended).
    pub name: String,
    /// The model id; a provider-qualified id (`anthropic:claude-x`) is reduced to `claude-x`.
    pub model: String,
    /// The system prompt.
    pub system: String,
    /// Custom tools, run locally (usually the handler's `tools()`).
    pub tools: Vec<ToolSpec>,
    /// Other tool entries sent verbatim (e.g. `{"type":"agent_toolset_20260401"}`).
    pub builtin_tools: Vec<Value>,
    /// The environment's config (default: cloud, unrestricted networking).
    pub environment_config: Option<Value>,
}

impl AgentSpec {
    /// An agent named `name` (a digest is appended) on `model`, with no system prompt or tools.
    pub fn new(name: impl Into<String>, model: impl Into<String>) -> Self {
        AgentSpec {
            name: name.into(),
            model: model.into(),
            system: String::new(),
            tools: Vec::new(),
            builtin_tools: Vec::new(),
            environment_config: None,
        }
    }

    /// The same agent with a system prompt.
    pub fn with_system(mut self, system: impl Into<String>) -> Self {
        self.system = system.into();
        self
    }

    /// The same agent with custom tools, run locally.
    pub fn with_tools(mut self, tools: Vec<ToolSpec>) -> Self {
        self.tools = tools;
        self
    }

    /// The same agent with tool entries sent verbatim.
    pub fn with_builtin_tools(mut self, tools: Vec<Value>) -> Self {
        self.builtin_tools = tools;
        self
    }

    /// The same agent with its environment's config.
    pub fn with_environment_config(mut self, config: Value) -> Self {
        self.environment_config = Some(config);
        self
    }
}

/// What [`provision`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Provisioned {
    /// The agent's id.
    pub agent_id: String,
    /// The environment's id.
    pub environment_id: String,
    /// The agent's name.
    pub agent_name: String,
    /// Whether this call created the agent (else it adopted an existing one).
    pub created_agent: bool,
    /// Whether this call created the environment.
    pub created_environment: bool,
}

fn canonical(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical(&m[k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(canonical).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The model id without a provider prefix.
pub fn normalize_model(model: &str) -> &str {
    model.strip_prefix("anthropic:").unwrap_or(model)
}

impl AgentSpec {
    fn tools_json(&self) -> Vec<Value> {
        let mut tools = self.builtin_tools.clone();
        tools.extend(self.tools.iter().map(|t| {
            json!({"type": "custom", "name": t.name, "description": t.description, "input_schema": t.input_schema})
        }));
        tools
    }

    /// 8 hex digits identifying everything but the name.
    pub fn digest(&self) -> String {
        let v = json!({
            "model": normalize_model(&self.model),
            "system": self.system,
            "tools": self.tools_json(),
            "environment": self.environment_config,
        });
        format!("{:08x}", fnv1a(&canonical(&v)) >> 32)
    }

    /// The content-addressed agent name (at most 256 characters).
    pub fn agent_name(&self) -> String {
        let mut base = self.name.clone();
        if base.len() > 240 {
            let mut end = 240;
            while !base.is_char_boundary(end) {
                end -= 1;
            }
            base = format!("{}_{:06x}", &base[..end], fnv1a(&self.name) & 0xff_ffff);
        }
        format!("{base}_{}", self.digest())
    }
}

async fn create_or_adopt(api: &ApiClient, collection: &str, body: &Value) -> tether::Result<(String, bool)> {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    match api.json(Method::POST, collection, Some(body)).await {
        Ok(v) => v["id"]
            .as_str()
            .map(|id| (id.to_owned(), true))
            .ok_or_else(|| Error::malformed(format!("POST {collection} answered without an id"))),
        Err(e) if e.status() == Some(409) => {
            let mut page: Option<String> = None;
            let mut cursors = std::collections::HashSet::new();
            loop {
                let path = match &page {
                    Some(p) => format!("{collection}?limit=100&page={p}"),
                    None => format!("{collection}?limit=100"),
                };
                let list = api.json(Method::GET, &path, None).await?;
                for item in list["data"].as_array().into_iter().flatten() {
                    if item["name"].as_str() == Some(name.as_str()) {
                        if !item["archived_at"].is_null() {
                            return Err(Error::provider(
                                "managed",
                                format!("{collection}: `{name}` exists but is archived; choose another name"),
                            ));
                        }
                        if let Some(id) = item["id"].as_str() {
                            return Ok((id.to_owned(), false));
                        }
                    }
                }
                match list["next_page"].as_str().filter(|s| !s.is_empty()) {
                    Some(n) if cursors.insert(n.to_owned()) => page = Some(n.to_owned()),
                    _ => break,
                }
            }
            Err(Error::provider(
                "managed",
                format!(
                    "{collection}: creating `{name}` conflicted (409) and no resource of that exact name was found"
                ),
            ))
        }
        Err(e) => Err(e),
    }
}

/// Creates (or finds) the agent and environment for `spec`. If the environment cannot be
/// provisioned, an agent this call created is archived again before the error is returned.
pub async fn provision(config: &ClientConfig, spec: &AgentSpec) -> tether::Result<Provisioned> {
    let api = ApiClient::new(config.clone(), Some(MANAGED_AGENTS_BETA.into()))?;
    let agent_name = spec.agent_name();
    let agent_body = json!({
        "name": agent_name,
        "model": normalize_model(&spec.model),
        "system": spec.system,
        "tools": spec.tools_json(),
    });
    let (agent_id, created_agent) = create_or_adopt(&api, "/v1/agents", &agent_body).await?;
    let mut env_body = Map::new();
    env_body.insert("name".into(), json!(format!("{agent_name}_env")));
    env_body.insert(
        "config".into(),
        spec.environment_config
            .clone()
            .unwrap_or_else(|| json!({"type": "cloud", "networking": {"type": "unrestricted"}})),
    );
    match create_or_adopt(&api, "/v1/environments", &Value::Object(env_body)).await {
        Ok((environment_id, created_environment)) => Ok(Provisioned {
            agent_id,
            environment_id,
            agent_name,
            created_agent,
            created_environment,
        }),
        Err(e) => {
            if created_agent {
                let path = format!("/v1/agents/{agent_id}/archive");
                if let Err(re) = api.json(Method::POST, &path, None).await {
                    tracing::warn!(error = %re, agent_id, "rolling back the agent failed");
                    return Err(Error::provider(
                        "managed",
                        format!(
                            "creating the environment failed ({e}); archiving agent {agent_id} also failed ({re})"
                        ),
                    ));
                }
            }
            Err(e)
        }
    }
}

/// Archives what [`provision`] created (both attempted even if one fails).
pub async fn teardown(config: &ClientConfig, p: &Provisioned) -> tether::Result<()> {
    let api = ApiClient::new(config.clone(), Some(MANAGED_AGENTS_BETA.into()))?;
    let a = api
        .json(Method::POST, &format!("/v1/agents/{}/archive", p.agent_id), None)
        .await;
    let e = api
        .json(
            Method::POST,
            &format!("/v1/environments/{}/archive", p.environment_id),
            None,
        )
        .await;
    a.and(e).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_content_addressed_and_bounded() {
        let spec = AgentSpec {
            name: "helper".into(),
            model: "anthropic:claude-x".into(),
            system: "s".into(),
            tools: vec![],
            builtin_tools: vec![],
            environment_config: None,
        };
        let n = spec.agent_name();
        assert!(n.starts_with("helper_") && n.len() == "helper_".len() + 8, "{n}");
        let mut other = spec.clone();
        other.name = "other".into();
        assert_eq!(other.digest(), spec.digest());
        other.system = "t".into();
        assert_ne!(other.digest(), spec.digest());
        let long = AgentSpec {
            name: "é".repeat(200),
            ..spec
        };
        assert!(long.agent_name().len() <= 256);
        assert_eq!(
            canonical(&json!({"b":1,"a":[2,{"d":3,"c":4}]})),
            r#"{"a":[2,{"c":4,"d":3}],"b":1}"#
        );
    }
}
