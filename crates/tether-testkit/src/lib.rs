//! Scripted fake servers for tether's tests: real HTTP on 127.0.0.1, with fault injection.
//!
//! Every fake serves plain HTTP/1.1 by default, or TLS with a generated CA and HTTP/2 (ALPN)
//! when started with [`Serve::tls`] (see [`server`]).
pub mod agentcore;
pub mod anthropic;
pub mod managed;
pub mod openai;
pub mod server;

pub use server::{Negotiated, Serve, TestCa};
