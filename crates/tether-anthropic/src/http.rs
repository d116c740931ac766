//! HTTP plumbing shared by the Messages model and the Managed Agents provider: the API key
//! (redacted in `Debug`), the client configuration, and the mapping of HTTP and transport failures
//! onto typed [`tether::Error`]s the shared retry policy can classify.

use std::time::Duration;

use reqwest::header::HeaderMap;
use serde_json::Value;
use tether::{Error, retry::parse_retry_after};

/// The default API origin.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
/// The `anthropic-version` header value.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// An Anthropic API key. Its `Debug` output never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps a key.
    pub fn new(key: impl Into<String>) -> Self {
        ApiKey(key.into())
    }

    /// The key itself, for the `x-api-key` header.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Where and how to reach the API.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientConfig {
    /// The API key (`x-api-key`).
    pub api_key: ApiKey,
    /// The API origin (default [`DEFAULT_BASE_URL`]); tests point it at a fake.
    pub base_url: String,
    /// The `anthropic-version` header (default [`ANTHROPIC_VERSION`]).
    pub anthropic_version: String,
    /// Timeout for connecting (streams have no overall timeout: heartbeats keep them alive).
    pub connect_timeout: Duration,
    /// Timeout for control-plane calls that return at once (default 60 s).
    pub request_timeout: Duration,
    /// Extra CA certificates to trust beside the built-in roots, as PEM bundles (default none);
    /// see [`ClientConfig::add_root_certificates_pem`].
    pub root_certificates: Vec<String>,
}

impl ClientConfig {
    /// A configuration with `api_key` and the defaults.
    pub fn new(api_key: impl Into<String>) -> Self {
        ClientConfig {
            api_key: ApiKey::new(api_key),
            base_url: DEFAULT_BASE_URL.into(),
            anthropic_version: ANTHROPIC_VERSION.into(),
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            root_certificates: Vec::new(),
        }
    }

    /// Reads `ANTHROPIC_API_KEY` (required) and `ANTHROPIC_BASE_URL` (optional).
    pub fn from_env() -> tether::Result<Self> {
        let key = std::env::var("ANTHROPIC_API_KEY")
            .ok()
            .filter(|k| !k.trim().is_empty())
            .ok_or_else(|| {
                Error::Auth("ANTHROPIC_API_KEY is not set: export your Anthropic API key".into())
            })?;
        let mut c = ClientConfig::new(key);
        if let Ok(u) = std::env::var("ANTHROPIC_BASE_URL")
            && !u.trim().is_empty()
        {
            c.base_url = u;
        }
        Ok(c)
    }

    /// The same configuration with another origin.
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = url.into();
        self
    }

    /// The same configuration also trusting the CA certificates in `pem` (one or more
    /// `-----BEGIN CERTIFICATE-----` blocks, e.g. a `.pem` or `.crt` file's text) beside the
    /// built-in Mozilla roots: for an origin or a TLS-inspecting proxy whose certificate chains to
    /// a private CA. Verification stays on. May be called more than once; a bundle that holds no
    /// certificate fails building the model or provider with [`Error::Config`].
    pub fn add_root_certificates_pem(mut self, pem: impl Into<String>) -> Self {
        self.root_certificates.push(pem.into());
        self
    }

    /// `base_url` + `path`, without a doubled slash.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url.trim_end_matches('/'), path)
    }

    pub(crate) fn client(&self) -> tether::Result<reqwest::Client> {
        tether_http::add_root_certificates(reqwest::Client::builder(), &self.root_certificates)?
            .connect_timeout(self.connect_timeout)
            .build()
            .map_err(|e| Error::config_with(tether::ConfigKind::Setup, "cannot build the HTTP client", e))
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Turns a non-success response into [`Error::Http`], reading Anthropic's error envelope
/// (`{"type":"error","error":{"type","message"}}`) and the retry headers.
pub async fn error_from_response(resp: reqwest::Response, endpoint: &str) -> Error {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let retry_after = parse_retry_after(
        header(&headers, "retry-after-ms"),
        header(&headers, "retry-after"),
    );
    let should_retry = match header(&headers, "x-should-retry") {
        Some("true") => Some(true),
        Some("false") => Some(false),
        _ => None,
    };
    // At most 64 KiB of it, each read within 30 s: the server chooses the body.
    let body = tether_http::error_text(resp, Duration::from_secs(30)).await;
    let (mut message, code) = match serde_json::from_str::<Value>(&body) {
        Ok(v) => (
            v["error"]["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| truncate(&body)),
            v["error"]["type"].as_str().map(str::to_owned),
        ),
        Err(_) => (truncate(&body), None),
    };
    if status == 401 || status == 403 {
        message =
            format!("{message} (check the API key: ANTHROPIC_API_KEY, and its access to this resource)");
    }
    Error::Http {
        status,
        message,
        code,
        retry_after,
        should_retry,
        endpoint: endpoint.to_owned(),
    }
}

fn truncate(s: &str) -> String {
    let s = s.trim();
    if s.len() <= 500 {
        return s.to_owned();
    }
    let mut end = 500;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Maps a reqwest failure onto [`Error::Transport`] (shared with every HTTP provider).
pub use tether_http::transport_error;

/// An error event inside a 200 stream (`event: error`), as [`Error::Stream`].
pub fn stream_error(data: &Value) -> Error {
    let err = if data["error"].is_object() {
        &data["error"]
    } else {
        data
    };
    Error::Stream {
        message: err["message"]
            .as_str()
            .unwrap_or("unknown stream error")
            .to_owned(),
        code: err["type"].as_str().map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_redacted() {
        let c = ClientConfig::new("sk-ant-secret");
        assert!(!format!("{c:?}").contains("secret"));
    }
}

/// The largest JSON answer the control-plane client reads (64 MiB: a history page of large
/// events fits many times over).
pub const MAX_JSON: usize = 64 << 20;

/// A JSON client for Anthropic's control plane (Managed Agents): every call carries the key,
/// the version, and the beta header when one is set. POSTs are never retried here: a retried
/// POST could deliver a tool result twice; callers reconcile through history instead.
#[derive(Debug, Clone)]
pub struct ApiClient {
    config: ClientConfig,
    http: reqwest::Client,
    beta: Option<String>,
    /// The `traceparent` requests carry while the session is traced (shared by clones).
    trace: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl ApiClient {
    /// A client for `config`, sending `anthropic-beta: <beta>` when given.
    pub fn new(config: ClientConfig, beta: Option<String>) -> tether::Result<Self> {
        Ok(ApiClient {
            http: config.client()?,
            config,
            beta,
            trace: Default::default(),
        })
    }

    /// Sets the `traceparent` the following requests carry (`None`: none), from the session's
    /// [`tether::EventSink::traceparent`].
    pub fn set_traceparent(&self, traceparent: Option<String>) {
        if let Ok(mut g) = self.trace.lock() {
            *g = traceparent;
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let mut rb = self
            .http
            .request(method, url)
            .header("x-api-key", self.config.api_key.expose())
            .header("anthropic-version", &self.config.anthropic_version);
        if let Some(b) = &self.beta {
            rb = rb.header("anthropic-beta", b);
        }
        let tp = self.trace.lock().ok().and_then(|g| g.clone());
        tether_http::with_traceparent(rb, tp)
    }

    /// Calls `method path` with an optional JSON body; returns the JSON answer (`null` if empty).
    pub async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> tether::Result<Value> {
        let url = self.config.url(path);
        let mut rb = self
            .request(method, &url)
            .timeout(self.config.request_timeout)
            .header("accept", "application/json");
        if let Some(b) = body {
            rb = rb.json(b);
        }
        let resp = rb.send().await.map_err(|e| transport_error(e, &url))?;
        if !resp.status().is_success() {
            return Err(error_from_response(resp, &url).await);
        }
        let body = tether_http::read_body(resp, MAX_JSON, self.config.request_timeout, &url).await?;
        if body.truncated {
            return Err(Error::malformed(format!(
                "{url} answered with more than {MAX_JSON} bytes; refusing to read further"
            )));
        }
        if body.bytes.trim_ascii().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body.bytes)
            .map_err(|e| Error::malformed_with(format_args!("{url} answered with invalid JSON"), e))
    }

    /// Opens a server-sent-events stream at `path` (no overall timeout).
    pub async fn sse(&self, path: &str) -> tether::Result<reqwest::Response> {
        let url = self.config.url(path);
        let send = self
            .request(reqwest::Method::GET, &url)
            .header("accept", "text/event-stream")
            .send();
        // The headers within the request timeout; the body is read under the stream's idle bound.
        let resp = tokio::time::timeout(self.config.request_timeout, send)
            .await
            .map_err(|_| {
                Error::transport(
                    tether::TransportKind::Timeout,
                    format!(
                        "the event stream did not answer within {:?}",
                        self.config.request_timeout
                    ),
                    url.clone(),
                )
            })?
            .map_err(|e| transport_error(e, &url))?;
        if !resp.status().is_success() {
            return Err(error_from_response(resp, &url).await);
        }
        Ok(resp)
    }
}
