//! # tether-agentcore
//!
//! A [`tether::Provider`] for Amazon Bedrock AgentCore, in two modes:
//! - **Harness** (`InvokeHarness`): the managed agent loop; the response is an AWS event stream
//!   of Converse-shaped events, folded by `toolUseId`; inline-function tools come back as
//!   `RequiresAction` and are resumed with the two-message `toolUse` + `toolResult` input.
//! - **Runtime** (`InvokeAgentRuntime`): a container we (or others) deploy; JSON or SSE bodies.
//!
//! Requests are SigV4-signed ([`sigv4`], session tokens supported); event-stream frames are
//! decoded with `aws-smithy-eventstream`, their CRCs checked ([`eventstream`]). A failed or
//! truncated turn is retried (2 retries by default) with the same turn id, sent as the
//! `X-Amzn-Bedrock-AgentCore-Runtime-Custom-Turn-Id` header (and `turn_id` in runtime payloads)
//! so a container can drop duplicates; a turn still truncated after its retries ends
//! `Terminated` with stop reason `early_termination`. Exception frames are recorded as error
//! events and end the turn with [`tether::Error::Stream`], never retried. A stream silent for
//! longer than the idle timeout (default 300 s) between chunks fails the attempt.
//!
//! This crate never depends on a front-end crate.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> tether::Result<()> {
//! # // A scripted AgentCore data plane on 127.0.0.1 stands in for AWS here.
//! # use tether_testkit::agentcore::{FakeAgentCore, Reply, golden_frames};
//! # let fake = FakeAgentCore::start(vec![Reply::Frames(golden_frames("final_turn.json"))]).await;
//! use tether::Session;
//! use tether_agentcore::{AgentCore, AgentCoreConfig, AwsCredentials, Target};
//! let target = Target::Harness {
//!     arn: "arn:aws:bedrock-agentcore:us-east-1:123456789012:harness/helper_abc-0123456789".into(),
//!     qualifier: None,
//! };
//! // AgentCoreConfig::from_env(target, None) takes the region and credentials from AWS_*.
//! let mut config = AgentCoreConfig::new(target, "us-east-1", AwsCredentials::new("AKID", "secret", None));
//! # config.endpoint = Some(fake.url());
//! let result = Session::builder(AgentCore::new(config)?).run("What is x?").await?;
//! assert_eq!(result.text, "x is 42.");
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

pub mod converse;
pub mod eventstream;
// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
pub mod provider;
pub mod sigv4;

pub use provider::{AgentCore, AgentCoreConfig, Target};
pub use sigv4::AwsCredentials;
