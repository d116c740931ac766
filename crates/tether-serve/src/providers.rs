//! One place that turns a provider's options into a [`Provider`]: `tether run --provider …` and
//! each agent of `tether serve` build their providers here (the remote loops, the Anthropic local
//! loop, and in `tether serve` the local loop over an OpenAI-compatible or embedded model).
//!
//! The options are already resolved by the caller (flags or a config file, credentials read from
//! the environment variables it names); [`ProviderSpec::build`] only assembles, so both front
//! doors build the same provider from the same options.

use std::path::PathBuf;
use std::sync::Arc;

use tether::local::LocalLoop;
use tether::{ChatModel, Provider};
use tether_acp::{AcpAgent, AgentCommand, ClientOptions};
use tether_agentcore::{AgentCore, AgentCoreConfig};
use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig, MessagesModel};

/// The default model of the `anthropic` provider.
pub const DEFAULT_ANTHROPIC_MODEL: &str = "claude-sonnet-4-5";

/// How a Managed Agents provider finds its session.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ManagedStart {
    /// A new session of this agent in this environment (a thread's later requests reattach to
    /// it by the session id its record keeps).
    New {
        /// The Managed Agents agent id.
        agent_id: String,
        /// The environment id.
        environment_id: String,
    },
    /// Reattach to an existing session.
    Reattach {
        /// The session id.
        session_id: String,
    },
}

/// The local loop over a chat model built once by the caller (an OpenAI-compatible endpoint's
/// client, an embedded GGUF model) and shared by every session built from it: a server builds
/// one provider per request, and the model's connections and weights must not be rebuilt each
/// time.
#[derive(Clone)]
#[non_exhaustive]
pub struct LocalSpec {
    /// The model.
    pub model: Arc<dyn ChatModel>,
    /// The model name sent with every request (empty: the model's default).
    pub model_name: String,
    /// The system prompt.
    pub system: Option<String>,
}

impl LocalSpec {
    /// The local loop over `model`, asking for `model_name`, with the system prompt `system`.
    pub fn new(model: Arc<dyn ChatModel>, model_name: impl Into<String>, system: Option<String>) -> Self {
        LocalSpec {
            model,
            model_name: model_name.into(),
            system,
        }
    }
}

impl std::fmt::Debug for LocalSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalSpec")
            .field("model", &self.model.name())
            .field("model_name", &self.model_name)
            .field("system", &self.system.is_some())
            .finish()
    }
}

/// A provider's resolved options: what [`ProviderSpec::build`] turns into a [`Provider`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ProviderSpec {
    /// The local loop over a model already built ([`LocalSpec`]).
    Local(LocalSpec),
    /// The local loop over the Anthropic Messages API.
    Anthropic {
        /// The API client's key and origin.
        client: ClientConfig,
        /// The model.
        model: String,
        /// The system prompt.
        system: Option<String>,
        /// Whether to stream responses.
        stream: bool,
    },
    /// Claude Managed Agents (remote loop, tools kept local).
    Managed {
        /// The API client's key and origin.
        client: ClientConfig,
        /// A new session or an existing one.
        start: ManagedStart,
    },
    /// Amazon Bedrock AgentCore (remote loop, tools kept local).
    AgentCore(Box<AgentCoreConfig>),
    /// An ACP agent subprocess, started in `cwd` (whose files and terminals the handler serves).
    Acp {
        /// The agent's argv (program first).
        command: Vec<String>,
        /// Its working directory: the agent's workspace root.
        cwd: PathBuf,
        /// Reload this session (`session/load`) instead of starting one.
        session_id: Option<String>,
        /// Bound the whole prompt turn at the client (None: the session's own limits bound it).
        prompt_timeout: Option<std::time::Duration>,
    },
}

impl ProviderSpec {
    /// The provider's short name (`local`, `anthropic`, `managed`, `agentcore`, `acp`).
    pub fn kind(&self) -> &'static str {
        match self {
            ProviderSpec::Local(_) => "local",
            ProviderSpec::Anthropic { .. } => "anthropic",
            ProviderSpec::Managed { .. } => "managed",
            ProviderSpec::AgentCore(_) => "agentcore",
            ProviderSpec::Acp { .. } => "acp",
        }
    }

    /// Builds the provider. Errors are messages a person can act on.
    pub fn build(&self) -> Result<Box<dyn Provider>, String> {
        match self {
            ProviderSpec::Local(l) => {
                let mut p = LocalLoop::with_model(l.model.clone()).model_name(l.model_name.clone());
                if let Some(s) = l.system.clone().filter(|s| !s.trim().is_empty()) {
                    p = p.system_prompt(s);
                }
                Ok(Box::new(p))
            }
            ProviderSpec::Anthropic {
                client,
                model,
                system,
                stream,
            } => {
                let m = MessagesModel::new(client.clone(), model.clone())
                    .map_err(|e| e.to_string())?
                    .stream(*stream);
                let mut p = LocalLoop::new(m).model_name(model.clone());
                if let Some(s) = system.clone().filter(|s| !s.trim().is_empty()) {
                    p = p.system_prompt(s);
                }
                Ok(Box::new(p))
            }
            ProviderSpec::Managed { client, start } => {
                let cfg = match start {
                    ManagedStart::New {
                        agent_id,
                        environment_id,
                    } => ManagedConfig::new(client.clone(), agent_id.clone(), environment_id.clone()),
                    ManagedStart::Reattach { session_id } => {
                        ManagedConfig::reattach(client.clone(), session_id.clone())
                    }
                };
                Ok(Box::new(ManagedAgents::new(cfg).map_err(|e| e.to_string())?))
            }
            ProviderSpec::AgentCore(cfg) => Ok(Box::new(
                AgentCore::new((**cfg).clone()).map_err(|e| e.to_string())?,
            )),
            ProviderSpec::Acp {
                command,
                cwd,
                session_id,
                prompt_timeout,
            } => {
                let Some(cmd) = AgentCommand::from_argv(command) else {
                    return Err("the acp provider needs the agent command, e.g. \
                                [\"gemini\", \"--experimental-acp\"]"
                        .into());
                };
                let options = ClientOptions::default().with_prompt_timeout(*prompt_timeout);
                let mut agent = AcpAgent::new(cmd.current_dir(cwd), cwd.clone()).options(options);
                if let Some(sid) = session_id.clone().filter(|s| !s.trim().is_empty()) {
                    agent = agent.load_session(sid);
                }
                Ok(Box::new(agent))
            }
        }
    }
}
