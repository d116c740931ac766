//! The Messages and Managed Agents streams' Server-Sent Events: the workspace's one decoder,
//! [`tether_http::sse`], under the names this crate's modules use.

pub(crate) use tether_http::sse::{MAX_FRAME, SseDecoder, SseFrame};
