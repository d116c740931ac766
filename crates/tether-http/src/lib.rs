//! HTTP plumbing shared by tether's provider crates (`tether-openai`, `tether-anthropic`,
//! `tether-agentcore`): one place that turns `reqwest` failures and retry headers into the typed
//! [`tether::Error`] the shared [`tether::RetryPolicy`] classifies, and the one Server-Sent Events
//! decoder they all read their streams with ([`sse`]).
//!
//! A failed request becomes a typed error the retry policy can match on, and a response's retry
//! headers a [`RetryHeaders`]:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use reqwest::header::{HeaderMap, HeaderValue};
//! use std::time::Duration;
//! use tether::TransportKind;
//!
//! // A port nobody listens on: the connection is refused.
//! let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
//! let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
//! let err = reqwest::get(&url).await.expect_err("nothing listens there");
//! assert_eq!(tether_http::classify(&err), TransportKind::Refused);
//! let typed = tether_http::transport_error(err, &url); // a tether::Error::Transport
//! assert!(matches!(typed, tether::Error::Transport { .. }));
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after-ms", HeaderValue::from_static("1500"));
//! headers.insert("x-should-retry", HeaderValue::from_static("true"));
//! let retry = tether_http::retry_headers(&headers);
//! assert_eq!(retry.retry_after, Some(Duration::from_millis(1500)));
//! assert_eq!(retry.should_retry, Some(true));
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

#[cfg(feature = "lean-client")]
pub mod lean;
pub mod sse;

use std::time::Duration;

use tether::{Error, TransportKind};

/// How a reqwest error failed, from its flags and its chain of sources.
///
/// reqwest's own flags say little (`is_connect`, `is_body`); the io and hyper errors in the chain
/// tell a refused connection from a reset one, and a closed stream from a timeout.
pub fn classify(e: &reqwest::Error) -> TransportKind {
    if e.is_timeout() {
        return if e.is_connect() {
            TransportKind::ConnectTimeout
        } else {
            TransportKind::Timeout
        };
    }
    if let Some(k) = classify_chain(e, e.is_connect()) {
        return k;
    }
    if e.is_connect() {
        return TransportKind::Refused;
    }
    if e.is_body() || e.is_decode() {
        // A body that failed mid-read: the connection went away.
        return TransportKind::Closed;
    }
    TransportKind::Other
}

/// The transport failure named by the io or hyper errors in `e`'s chain of sources, if any
/// (`connecting`: the error happened while connecting, so a timeout is a connect timeout).
///
/// For errors of HTTP clients other than reqwest (`tether-openai`'s lean client, whose failures
/// are `io::Error`s): the same chain, read the same way.
pub fn classify_chain(e: &(dyn std::error::Error + 'static), connecting: bool) -> Option<TransportKind> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if tls_error(s).is_some() {
            // A failed handshake (an untrusted or expired certificate, a name mismatch, no common
            // protocol): retrying does not heal it, so it is not a refused connection.
            return Some(TransportKind::Other);
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            match io.kind() {
                K::ConnectionRefused => return Some(TransportKind::Refused),
                K::ConnectionReset => return Some(TransportKind::Reset),
                K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof | K::NotConnected => {
                    return Some(TransportKind::Closed);
                }
                K::TimedOut => {
                    return Some(if connecting {
                        TransportKind::ConnectTimeout
                    } else {
                        TransportKind::Timeout
                    });
                }
                _ => {}
            }
        }
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                return Some(TransportKind::Timeout);
            }
            if h.is_incomplete_message() || h.is_closed() || h.is_canceled() {
                return Some(TransportKind::Closed);
            }
        }
        src = s.source();
    }
    None
}

/// The rustls error `e` is or wraps. tokio-rustls reports a failed handshake as an `io::Error`
/// holding it, which hyper-rustls wraps in another `io::Error`; `source()` skips over both
/// (an `io::Error`'s source is its inner error's source), so this looks inside them.
fn tls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur = e;
    loop {
        if let Some(t) = cur.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        cur = cur.downcast_ref::<std::io::Error>()?.get_ref()?;
    }
}

/// What to do about a certificate the client refused, if `e`'s chain holds one.
fn certificate_hint(e: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(rustls::Error::InvalidCertificate(_)) = tls_error(s) {
            return Some(
                "the server's TLS certificate is not trusted; if it chains to a private CA, such \
                 as a corporate proxy's, trust that CA with the provider's \
                 add_root_certificates_pem option",
            );
        }
        src = s.source();
    }
    None
}

/// The error and its sources, joined (`error sending request: connection refused`).
pub fn describe(e: &reqwest::Error) -> String {
    describe_chain(e)
}

/// Any error and its sources, joined, each source once.
pub fn describe_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !out.contains(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        src = s.source();
    }
    out
}

/// A reqwest failure as [`Error::Transport`], naming what was called; the reqwest error is kept
/// as its source.
pub fn transport_error(e: reqwest::Error, endpoint: &str) -> Error {
    let mut message = describe(&e);
    if let Some(hint) = certificate_hint(&e) {
        message.push_str(" -- ");
        message.push_str(hint);
    }
    Error::transport_with(classify(&e), message, endpoint, e)
}

/// `builder` also trusting the CA certificates in each PEM bundle of `pems` (beside its built-in
/// roots), for endpoints whose certificate chains to a private CA: a corporate TLS-inspecting
/// proxy, a self-hosted gateway, a test server. Certificate verification stays on; this only
/// widens whom it trusts. The provider crates' builders take the bundles
/// (`add_root_certificates_pem`) and call this when they build their client.
///
/// Errors: [`Error::Config`] naming the bundle that is malformed or holds no `CERTIFICATE` block.
pub fn add_root_certificates(
    mut builder: reqwest::ClientBuilder,
    pems: &[String],
) -> Result<reqwest::ClientBuilder, Error> {
    for (i, pem) in pems.iter().enumerate() {
        let certs = reqwest::Certificate::from_pem_bundle(pem.as_bytes()).map_err(|e| {
            Error::config(
                tether::ConfigKind::Invalid,
                format!(
                    "extra root certificate bundle #{} is not valid PEM: {}",
                    i + 1,
                    describe(&e)
                ),
            )
        })?;
        if certs.is_empty() {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                format!(
                    "extra root certificate bundle #{} holds no -----BEGIN CERTIFICATE----- block",
                    i + 1
                ),
            ));
        }
        for c in certs {
            builder = builder.add_root_certificate(c);
        }
    }
    Ok(builder)
}

/// The W3C Trace Context header naming the span a request belongs to.
pub const TRACEPARENT: &str = "traceparent";

/// The hook through which a provider's outgoing requests join a trace: `traceparent` (from
/// [`tether::DeltaSink::traceparent`] or [`tether::EventSink::traceparent`]) as a header value,
/// when the work is traced and the value is well formed (`00-` 32 hex digits `-` 16 hex digits
/// `-` 2 hex digits, not all zero). Anything else gives `None`: a malformed value never reaches a
/// request (no line break can be smuggled into a header).
pub fn traceparent_header(traceparent: Option<String>) -> Option<reqwest::header::HeaderValue> {
    let tp = traceparent?;
    // Checked in place, byte by byte (no split into a vector: this runs per model request of a
    // traced session): `00-` <32 hex> `-` <16 hex> `-` <2 hex>, ids not all zero.
    let b = tp.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    let zero = |r: std::ops::Range<usize>| b[r].iter().all(|c| *c == b'0');
    let ok = b.len() == 55
        && b.starts_with(b"00-")
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(3..35)
        && !zero(3..35)
        && hex(36..52)
        && !zero(36..52)
        && hex(53..55);
    if !ok {
        return None;
    }
    // The string's own buffer becomes the header's (no copy).
    reqwest::header::HeaderValue::try_from(tp).ok()
}

/// `rb` with the `traceparent` header when the work is traced (see [`traceparent_header`]).
pub fn with_traceparent(rb: reqwest::RequestBuilder, traceparent: Option<String>) -> reqwest::RequestBuilder {
    match traceparent_header(traceparent) {
        Some(v) => rb.header(TRACEPARENT, v),
        None => rb,
    }
}

/// A response body read with [`read_body`]: at most the cap, and whether there was more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Body {
    /// The bytes read (at most the cap).
    pub bytes: Vec<u8>,
    /// Whether the body went on past the cap (it was not read further).
    pub truncated: bool,
}

/// Reads a body whose size the server chooses (an error message, a JSON answer) with bounds:
/// at most `cap` bytes are kept (the rest is not read), and each read must arrive within
/// `idle`, else [`TransportKind::Idle`]. A server cannot make the caller hold more than `cap`,
/// nor wait forever.
pub async fn read_body(
    mut resp: reqwest::Response,
    cap: usize,
    idle: Duration,
    endpoint: &str,
) -> Result<Body, Error> {
    let mut out = Body::default();
    loop {
        let chunk = match tokio::time::timeout(idle, resp.chunk()).await {
            Err(_) => {
                return Err(Error::transport(
                    TransportKind::Idle,
                    format!(
                        "the response body stalled for {idle:?} after {} bytes",
                        out.bytes.len()
                    ),
                    endpoint.to_owned(),
                ));
            }
            Ok(Err(e)) => return Err(transport_error(e, endpoint)),
            Ok(Ok(None)) => return Ok(out),
            Ok(Ok(Some(c))) => c,
        };
        let room = cap - out.bytes.len();
        if chunk.len() > room {
            out.bytes.extend_from_slice(&chunk[..room]);
            out.truncated = true;
            return Ok(out);
        }
        out.bytes.extend_from_slice(&chunk);
    }
}

/// The most of an error response's body read for its message (64 KiB).
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// An error response's body as text, best effort: at most [`MAX_ERROR_BODY`] bytes, read within
/// `idle` per read; whatever arrived before a failure.
pub async fn error_text(resp: reqwest::Response, idle: Duration) -> String {
    match read_body(resp, MAX_ERROR_BODY, idle, "").await {
        Ok(b) => String::from_utf8_lossy(&b.bytes).into_owned(),
        Err(_) => String::new(),
    }
}

/// What a response's headers say about retrying it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryHeaders {
    /// `retry-after-ms`, else `retry-after` (seconds).
    pub retry_after: Option<Duration>,
    /// `x-should-retry: true|false`.
    pub should_retry: Option<bool>,
}

/// Reads `retry-after-ms`, `retry-after` and `x-should-retry`.
pub fn retry_headers(h: &reqwest::header::HeaderMap) -> RetryHeaders {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok());
    RetryHeaders {
        retry_after: tether::retry::parse_retry_after(get("retry-after-ms"), get("retry-after")),
        should_retry: get("x-should-retry").and_then(|v| match v.trim() {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_is_refused() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(9);
        let e = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .expect_err("nothing listens there");
        let err = transport_error(e, "test");
        assert!(
            matches!(
                err,
                Error::Transport {
                    kind: TransportKind::Refused,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.is_transient());
        // The reqwest error is kept, not only its text.
        let source = std::error::Error::source(&err).expect("a source");
        assert!(source.is::<reqwest::Error>(), "{source:?}");
    }

    #[test]
    fn only_well_formed_traceparents_reach_a_request() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            traceparent_header(Some(good.into())).map(|v| v.to_str().map(str::to_owned).ok()),
            Some(Some(good.to_owned()))
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nx-evil: 1",
        ] {
            assert!(traceparent_header(Some(bad.into())).is_none(), "{bad:?}");
        }
        assert!(traceparent_header(None).is_none());
    }

    /// The definition the in-place check replaced: split on `-`, four parts, each checked.
    fn by_parts(tp: &str) -> bool {
        let parts: Vec<&str> = tp.split('-').collect();
        let hex = |s: &str, n: usize| {
            s.len() == n
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        parts.len() == 4
            && parts[0] == "00"
            && hex(parts[1], 32)
            && !zero(parts[1])
            && hex(parts[2], 16)
            && !zero(parts[2])
            && hex(parts[3], 2)
    }

    proptest::proptest! {
        /// Any string, and any one-byte change of a valid value (a dash moved, a digit made
        /// upper case or non-ASCII, a line break): accepted exactly when the split definition
        /// accepts it, and then unchanged.
        #[test]
        fn the_in_place_check_agrees_with_the_split_one(
            any in "[0-9a-fA-F\\-\r\né]{0,60}",
            at in 0usize..55,
            with in proptest::char::any(),
        ) {
            let mut one = String::from("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
            one.replace_range(at..at + 1, with.encode_utf8(&mut [0; 4]));
            for tp in [any, one] {
                let got = traceparent_header(Some(tp.clone()));
                proptest::prop_assert_eq!(got.is_some(), by_parts(&tp), "{:?}", tp);
                if let Some(v) = got {
                    proptest::prop_assert_eq!(v.as_bytes(), tp.as_bytes());
                }
            }
        }
    }

    #[test]
    fn reads_retry_headers() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("retry-after", "2".parse().unwrap_or_else(|_| unreachable!()));
        h.insert(
            "x-should-retry",
            "false".parse().unwrap_or_else(|_| unreachable!()),
        );
        let r = retry_headers(&h);
        assert_eq!(r.retry_after, Some(Duration::from_secs(2)));
        assert_eq!(r.should_retry, Some(false));
        h.insert("retry-after-ms", "250".parse().unwrap_or_else(|_| unreachable!()));
        assert_eq!(retry_headers(&h).retry_after, Some(Duration::from_millis(250)));
        // A hostile value never panics; a huge one reads as the maximum.
        h.insert(
            "retry-after-ms",
            "1e400".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(
            retry_headers(&h).retry_after,
            Some(tether::retry::MAX_RETRY_AFTER)
        );
    }

    /// A server that sends a body forever, or stalls in the middle of one.
    async fn server(body: &'static [u8], forever: bool) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|_| unreachable!());
        let addr = l.local_addr().unwrap_or_else(|_| unreachable!());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\n\r\n")
                        .await;
                    let _ = s.write_all(body).await;
                    if forever {
                        while s.write_all(body).await.is_ok() {}
                    } else {
                        std::future::pending::<()>().await;
                    }
                });
            }
        });
        format!("http://{addr}/")
    }

    #[tokio::test]
    async fn bodies_are_read_with_a_cap_and_an_idle_bound() {
        let url = server(b"0123456789abcdef", true).await;
        let resp = reqwest::get(&url).await.unwrap_or_else(|_| unreachable!());
        let b = read_body(resp, 1000, Duration::from_secs(30), "t")
            .await
            .unwrap_or_else(|_| unreachable!());
        assert_eq!(b.bytes.len(), 1000);
        assert!(b.truncated);

        let url = server(b"partial", false).await;
        let resp = reqwest::get(&url).await.unwrap_or_else(|_| unreachable!());
        // The idle bound under test.
        let e = read_body(resp, 1000, Duration::from_millis(200), "t").await;
        assert!(
            matches!(
                e,
                Err(Error::Transport {
                    kind: TransportKind::Idle,
                    ..
                })
            ),
            "{e:?}"
        );
        let resp = reqwest::get(&url).await.unwrap_or_else(|_| unreachable!());
        assert_eq!(error_text(resp, Duration::from_millis(200)).await, "");
    }
}
