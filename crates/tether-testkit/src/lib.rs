//! Scripted fake servers for tether's tests: real HTTP on 127.0.0.1, with fault injection.
//!
//! Every fake serves plain HTTP/1.1 by default, or TLS with a generated CA and HTTP/2 (ALPN)
//! when started with [`Serve::tls`] (see [`server`]).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tether_testkit::openai::{FakeOpenAi, Reply};
//! let server = FakeOpenAi::start().await;
//! server.push(Reply::text("Hello!").chunk_chars(2)); // streamed two characters per chunk
//! assert!(server.url().starts_with("http://127.0.0.1:"));
//! assert_eq!(server.remaining(), 1);
//! // Point an OpenAiModel at server.url(); server.requests() shows what it sent.
//! # }
//! ```
#![deny(missing_docs)]
pub mod agentcore;
pub mod anthropic;
pub mod managed;
pub mod openai;
pub mod otlp;
pub mod peers;
#[cfg(unix)]
pub mod postgres;
#[cfg(unix)]
pub mod restate;
pub mod server;

pub use server::{Negotiated, Serve, TestCa};
