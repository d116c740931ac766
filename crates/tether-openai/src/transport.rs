//! How requests reach the endpoint: reqwest, or — for a plain-`http` endpoint when a bounded
//! read buffer is asked for ([`crate::OpenAiBuilder::read_buffer`]) — the lean HTTP/1.1 client of
//! [`tether_http::lean`], which reads through a buffer of exactly that size.
//!
//! Why a second client: reqwest (hyper) grows a connection's read buffer while reads fill it, up
//! to about 400 KiB. A local model server streams faster than a relay forwards, so every read
//! fills the buffer; with 1,000 concurrent streams that is 150–250 KiB held per stream (measured
//! by the `tether serve` bench with heaptrack). reqwest stays the default, and the client for
//! `https` and for proxied endpoints (it does TLS, HTTP/2 and proxies; the lean client does none
//! of them).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, HeaderMap};
use tether::{Error, TransportKind};

use tether_http::lean::{Lean, LeanError, LeanResponse};

fn env(keys: &[&str]) -> Option<String> {
    keys.iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

/// Whether the environment routes `http` requests to `host` through a proxy (which only reqwest
/// honours): `HTTP_PROXY` or `ALL_PROXY` is set and `NO_PROXY` does not exempt the host.
fn proxied(host: &str) -> bool {
    env(&["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]).is_some()
        && !env(&["NO_PROXY", "no_proxy"]).is_some_and(|list| exempt(&list, host))
}

/// Whether a `NO_PROXY` list exempts `host`: `*`, the host itself, or a domain it is in
/// (`example.com` and `.example.com` both cover `api.example.com`). IP ranges (CIDR) are not
/// matched here: such a host keeps reqwest, which applies them.
fn exempt(list: &str, host: &str) -> bool {
    let host = host.trim_matches(['[', ']']).to_ascii_lowercase();
    list.split(',')
        .map(|e| e.trim().trim_start_matches('.').to_ascii_lowercase())
        .filter(|e| !e.is_empty())
        .any(|e| {
            let e = e.trim_matches(['[', ']']);
            e == "*" || e == host || host.ends_with(&format!(".{e}"))
        })
}

/// The client requests go through.
#[derive(Clone)]
pub(crate) enum Transport {
    Reqwest(reqwest::Client),
    Bounded(Arc<Lean>),
}

impl Transport {
    /// The bounded client when `read_buffer` is set, the endpoint is plain `http` and no proxy is
    /// configured; otherwise `None` (use reqwest).
    pub(crate) fn bounded(
        endpoint: &str,
        read_buffer: Option<usize>,
        headers: &HeaderMap,
        connect_timeout: Duration,
    ) -> Option<Transport> {
        let size = read_buffer?;
        let host = reqwest::Url::parse(endpoint).ok()?.host_str()?.to_owned();
        if !endpoint.starts_with("http://") || proxied(&host) {
            return None;
        }
        Lean::new(endpoint, headers, size, connect_timeout).map(|l| Transport::Bounded(Arc::new(l)))
    }

    /// Posts `body` to `url`, accepting `accept`; resolves with the response head.
    /// With `traceparent` (checked by [`tether_http::traceparent_header`]) as a header when the
    /// call is traced.
    pub(crate) async fn post(
        &self,
        url: &str,
        accept: &'static str,
        body: Vec<u8>,
        traceparent: Option<reqwest::header::HeaderValue>,
    ) -> Result<Response, TransportError> {
        match self {
            Transport::Reqwest(c) => {
                let mut rb = c.post(url).header(ACCEPT, accept).body(body);
                if let Some(tp) = traceparent {
                    rb = rb.header(tether_http::TRACEPARENT, tp);
                }
                rb.send()
                    .await
                    .map(Response::Reqwest)
                    .map_err(TransportError::Reqwest)
            }
            Transport::Bounded(l) => l
                .post_traced(url, accept, &body, traceparent.as_ref())
                .await
                .map(Response::Lean)
                .map_err(TransportError::Lean),
        }
    }
}

/// A response whose head has arrived.
pub(crate) enum Response {
    Reqwest(reqwest::Response),
    Lean(LeanResponse),
}

impl Response {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Response::Reqwest(r) => r.status(),
            Response::Lean(r) => r.status,
        }
    }

    pub(crate) fn headers(&self) -> &HeaderMap {
        match self {
            Response::Reqwest(r) => r.headers(),
            Response::Lean(r) => &r.headers,
        }
    }

    /// The next piece of the body; `None` at its end. Cancel safe: dropping the future before it
    /// completes loses no data.
    pub(crate) async fn chunk(&mut self) -> Result<Option<Bytes>, TransportError> {
        match self {
            Response::Reqwest(r) => r.chunk().await.map_err(TransportError::Reqwest),
            Response::Lean(r) => r.chunk().await.map_err(TransportError::Lean),
        }
    }
}

/// A failed request or body read, of either client.
#[derive(Debug)]
pub(crate) enum TransportError {
    Reqwest(reqwest::Error),
    Lean(LeanError),
}

impl TransportError {
    /// As [`Error::Transport`], naming the endpoint.
    pub(crate) fn into_error(self, endpoint: &str) -> Error {
        match self {
            TransportError::Reqwest(e) => tether_http::transport_error(e, endpoint),
            TransportError::Lean(LeanError {
                connecting, error, ..
            }) => {
                let kind = tether_http::classify_chain(&error, connecting).unwrap_or(if connecting {
                    TransportKind::Refused
                } else {
                    TransportKind::Other
                });
                Error::transport_with(kind, tether_http::describe_chain(&error), endpoint, error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exempt;

    #[test]
    fn no_proxy_exempts_hosts_domains_and_everything() {
        assert!(exempt("localhost,127.0.0.1", "127.0.0.1"));
        assert!(exempt("localhost, 127.0.0.1", "localhost"));
        assert!(exempt("*", "models.internal"));
        assert!(exempt("example.com", "api.example.com"));
        assert!(exempt(".example.com", "api.example.com"));
        assert!(exempt("EXAMPLE.com", "example.COM"));
        assert!(exempt("[::1]", "[::1]"));
        assert!(!exempt("example.com", "badexample.com"));
        assert!(!exempt("api.example.com", "example.com"));
        assert!(
            !exempt("10.0.0.0/8", "10.1.2.3"),
            "CIDR ranges are left to reqwest"
        );
        assert!(!exempt("", "localhost"));
    }
}
