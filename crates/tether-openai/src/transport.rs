//! How requests reach the endpoint: reqwest, or — for a plain-`http` endpoint when a bounded
//! read buffer is asked for ([`crate::OpenAiBuilder::read_buffer`]) — hyper's own pooled client
//! with a read buffer of exactly that size.
//!
//! Why a second client: hyper grows a connection's read buffer while reads fill it, up to about
//! 400 KiB. A local model server streams faster than a relay forwards, so every read fills the
//! buffer; with 1,000 concurrent streams that is 150–250 KiB held per stream (measured by the
//! `tether serve` bench with heaptrack). hyper can fix the size (`http1_read_buf_exact_size`) but
//! reqwest does not expose it. reqwest stays the default, and the client for `https` and for
//! proxied endpoints (it does TLS, HTTP/2 and proxies; the bounded client does none of them).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, HeaderMap, HeaderValue};
use tether::{Error, TransportKind};

/// Whether the environment routes `http` requests through a proxy (which only reqwest honours).
fn http_proxy_configured() -> bool {
    ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| !v.trim().is_empty()))
}

/// The client requests go through.
#[derive(Clone)]
pub(crate) enum Transport {
    Reqwest(reqwest::Client),
    Bounded(std::sync::Arc<Bounded>),
}

/// hyper's pooled client with a fixed read buffer.
pub(crate) struct Bounded {
    client: HyperClient<HttpConnector, Full<Bytes>>,
    /// Sent with every request (reqwest's `default_headers`).
    headers: HeaderMap,
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
        if !endpoint.starts_with("http://") || http_proxy_configured() {
            return None;
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let client = HyperClient::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            // hyper's minimum; below it the builder panics.
            .http1_read_buf_exact_size(size.max(8 * 1024))
            .build(connector);
        Some(Transport::Bounded(std::sync::Arc::new(Bounded {
            client,
            headers: headers.clone(),
        })))
    }

    /// Posts `body` to `url`, accepting `accept`; resolves with the response head.
    pub(crate) async fn post(
        &self,
        url: &str,
        accept: &'static str,
        body: Vec<u8>,
    ) -> Result<Response, TransportError> {
        match self {
            Transport::Reqwest(c) => c
                .post(url)
                .header(ACCEPT, accept)
                .body(body)
                .send()
                .await
                .map(Response::Reqwest)
                .map_err(TransportError::Reqwest),
            Transport::Bounded(b) => {
                let Bounded { client, headers } = b.as_ref();
                let mut req = hyper::Request::post(url)
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| TransportError::hyper(e, false))?;
                let h = req.headers_mut();
                h.clone_from(headers);
                h.insert(ACCEPT, HeaderValue::from_static(accept));
                client.request(req).await.map(Response::Hyper).map_err(|e| {
                    let connecting = e.is_connect();
                    TransportError::hyper(e, connecting)
                })
            }
        }
    }
}

/// A response whose head has arrived.
pub(crate) enum Response {
    Reqwest(reqwest::Response),
    Hyper(hyper::Response<hyper::body::Incoming>),
}

impl Response {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Response::Reqwest(r) => r.status(),
            Response::Hyper(r) => r.status(),
        }
    }

    pub(crate) fn headers(&self) -> &HeaderMap {
        match self {
            Response::Reqwest(r) => r.headers(),
            Response::Hyper(r) => r.headers(),
        }
    }

    /// The next piece of the body; `None` at its end. Cancel safe: dropping the future before it
    /// completes loses no data.
    pub(crate) async fn chunk(&mut self) -> Result<Option<Bytes>, TransportError> {
        match self {
            Response::Reqwest(r) => r.chunk().await.map_err(TransportError::Reqwest),
            Response::Hyper(r) => loop {
                match r.body_mut().frame().await {
                    None => return Ok(None),
                    Some(Err(e)) => return Err(TransportError::hyper(e, false)),
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data()
                            && !data.is_empty()
                        {
                            return Ok(Some(data));
                        }
                    }
                }
            },
        }
    }

    /// The whole body.
    pub(crate) async fn bytes(self) -> Result<Bytes, TransportError> {
        match self {
            Response::Reqwest(r) => r.bytes().await.map_err(TransportError::Reqwest),
            Response::Hyper(r) => r
                .into_body()
                .collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| TransportError::hyper(e, false)),
        }
    }
}

/// A failed request or body read, of either client.
#[derive(Debug)]
pub(crate) enum TransportError {
    Reqwest(reqwest::Error),
    Hyper {
        connecting: bool,
        error: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl TransportError {
    fn hyper(error: impl std::error::Error + Send + Sync + 'static, connecting: bool) -> Self {
        TransportError::Hyper {
            connecting,
            error: Box::new(error),
        }
    }

    /// As [`Error::Transport`], naming the endpoint.
    pub(crate) fn into_error(self, endpoint: &str) -> Error {
        match self {
            TransportError::Reqwest(e) => tether_http::transport_error(&e, endpoint),
            TransportError::Hyper { connecting, error } => {
                let kind = tether_http::classify_chain(error.as_ref(), connecting).unwrap_or(if connecting {
                    TransportKind::Refused
                } else {
                    TransportKind::Other
                });
                Error::Transport {
                    kind,
                    message: tether_http::describe_chain(error.as_ref()),
                    endpoint: endpoint.to_owned(),
                }
            }
        }
    }
}
