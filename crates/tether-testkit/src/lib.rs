//! Scripted fake servers for tether's tests: real HTTP on 127.0.0.1, with fault injection.
pub mod agentcore;
pub mod anthropic;
pub mod managed;
pub mod openai;
