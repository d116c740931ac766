//! How the fakes serve: plain HTTP/1.1 (the default), or TLS with a certificate generated at
//! start and HTTP/2 or HTTP/1.1 chosen by ALPN, as real providers serve. One piece of code for
//! every fake ([`crate::openai::FakeOpenAi`], [`crate::anthropic::FakeMessages`],
//! [`crate::managed::FakeManaged`], [`crate::agentcore::FakeAgentCore`]), each of which takes a
//! [`Serve`] in its `start_with` and reports what each request arrived over ([`Negotiated`]).
//!
//! ```no_run
//! # async fn f() {
//! use tether_testkit::openai::FakeOpenAi;
//! use tether_testkit::Serve;
//! let fake = FakeOpenAi::start_with(Serve::tls()).await;
//! assert!(fake.url().starts_with("https://127.0.0.1:"));
//! let ca_pem: &str = fake.ca().expect("a TLS fake has a CA").pem();
//! // give `ca_pem` to the client as an extra root certificate, send requests, then:
//! for n in fake.negotiated() {
//!     assert_eq!(n.alpn.as_deref(), Some("h2"));
//!     assert_eq!(n.http_version, "HTTP/2.0");
//! }
//! # let _ = ca_pem;
//! # }
//! ```
//!
//! The certificate chain is a fresh self-signed CA (per fake) and a leaf it signs for
//! `127.0.0.1`, `::1` and `localhost`; only a client that trusts [`TestCa::pem`] (or
//! [`TestCa::der`]) accepts it. The crypto provider is rustls' `ring`, the one reqwest's
//! `rustls-tls` builds.
//!
//! Faults behave over HTTP/2 as HTTP/2 makes them: a reply whose body fails mid-way (the
//! `drop_after` faults) resets that stream (`RST_STREAM` with `INTERNAL_ERROR`) where HTTP/1.1
//! cuts the connection; a stalled body stalls the stream; a body that ends early ends the stream
//! cleanly (`END_STREAM`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// How a fake serves its connections; pass it to a fake's `start_with`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Serve {
    tls: Option<Alpn>,
    /// Whether a TLS client must show a certificate the server's CA signed (mutual TLS).
    client_auth: bool,
}

/// The application protocols a TLS fake offers in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alpn {
    /// `h2` first, then `http/1.1`: a client that speaks HTTP/2 gets it (as from real providers).
    H2AndHttp1,
    /// `http/1.1` only (like a TLS-terminating proxy that does not speak HTTP/2).
    Http1,
}

impl Serve {
    /// Plain HTTP/1.1 on 127.0.0.1 (what `start` does).
    pub fn plain() -> Self {
        Serve {
            tls: None,
            client_auth: false,
        }
    }

    /// TLS on 127.0.0.1 with a certificate generated at start, offering ALPN `h2` then
    /// `http/1.1`: a client that speaks HTTP/2 gets HTTP/2, one that does not gets HTTP/1.1.
    pub fn tls() -> Self {
        Serve {
            tls: Some(Alpn::H2AndHttp1),
            client_auth: false,
        }
    }

    /// TLS as [`Serve::tls`], and mutual: a client must show a certificate the same CA signed
    /// ([`TestCa::client_cert_pem`] with [`TestCa::client_key_pem`]); one that shows none, or
    /// another, fails the handshake.
    pub fn tls_client_auth() -> Self {
        Serve {
            tls: Some(Alpn::H2AndHttp1),
            client_auth: true,
        }
    }

    /// TLS as [`Serve::tls`], but offering only `http/1.1` in ALPN (no HTTP/2).
    pub fn tls_http1_only() -> Self {
        Serve {
            tls: Some(Alpn::Http1),
            client_auth: false,
        }
    }

    /// Whether this serves TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }
}

/// What one request arrived over, as the server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Negotiated {
    /// The request method.
    pub method: String,
    /// The request path.
    pub path: String,
    /// The TLS version of the connection (`"TLSv1_3"`), `None` over plain TCP.
    pub tls_version: Option<String>,
    /// The ALPN protocol agreed in the TLS handshake (`"h2"`, `"http/1.1"`), `None` when none was
    /// (plain TCP, or a client that offered none).
    pub alpn: Option<String>,
    /// The HTTP version of the request (`"HTTP/1.1"`, `"HTTP/2.0"`).
    pub http_version: String,
}

impl Negotiated {
    /// Whether the request came over TLS with HTTP/2 agreed by ALPN.
    pub fn is_tls_h2(&self) -> bool {
        self.tls_version.is_some() && self.alpn.as_deref() == Some("h2") && self.http_version == "HTTP/2.0"
    }
}

/// The certificate authority a TLS fake's certificate chains to: trust it in the client.
#[derive(Clone)]
pub struct TestCa {
    pem: String,
    der: Vec<u8>,
    leaf: CertificateDer<'static>,
    leaf_key: Arc<Vec<u8>>,
    client_pem: String,
    client_key_pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("pem", &self.pem)
            .finish_non_exhaustive()
    }
}

impl TestCa {
    /// Generates a CA (`tether-testkit CA <pid>-<n>`, ECDSA P-256) and a server certificate it signs for
    /// `127.0.0.1`, `::1` and `localhost`. Each call makes a new, unrelated CA.
    ///
    /// # Panics
    /// When certificate generation fails (it does not with these fixed parameters).
    pub fn generate() -> Self {
        match Self::try_generate() {
            Ok(ca) => ca,
            Err(e) => panic!("tether-testkit: cannot generate a test CA: {e}"),
        }
    }

    fn try_generate() -> Result<Self, rcgen::Error> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
            KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A name of its own, as two unrelated CAs have: a client trusting another test CA then
        // finds no issuer at all (`UnknownIssuer`) rather than a namesake whose signature fails.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ca.distinguished_name.push(
            DnType::CommonName,
            format!("tether-testkit CA {}-{n}", std::process::id()),
        );
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let leaf_key = KeyPair::generate()?;
        let mut leaf = CertificateParams::new(vec![
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
            "localhost".to_owned(),
        ])?;
        leaf.distinguished_name
            .push(DnType::CommonName, "tether-testkit server");
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
        // A client certificate for mutual TLS ([`Serve::tls_client_auth`]).
        let client_key = KeyPair::generate()?;
        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client
            .distinguished_name
            .push(DnType::CommonName, "tether-testkit client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        client.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let client_cert = client.signed_by(&client_key, &issuer)?;
        Ok(TestCa {
            pem: ca_cert.pem(),
            der: ca_cert.der().to_vec(),
            leaf: leaf_cert.der().clone(),
            leaf_key: Arc::new(leaf_key.serialize_der()),
            client_pem: client_cert.pem(),
            client_key_pem: client_key.serialize_pem(),
        })
    }

    /// A client certificate this CA signed (PEM), for mutual TLS ([`Serve::tls_client_auth`]).
    pub fn client_cert_pem(&self) -> &str {
        &self.client_pem
    }

    /// The private key of [`TestCa::client_cert_pem`] (PEM, PKCS#8).
    pub fn client_key_pem(&self) -> &str {
        &self.client_key_pem
    }

    /// The CA certificate, PEM-encoded (one `CERTIFICATE` block).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The CA certificate, DER-encoded.
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    fn server_config(&self, alpn: Alpn, client_auth: bool) -> Result<rustls::ServerConfig, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.as_ref().clone()));
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = if client_auth {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(CertificateDer::from(self.der.clone()))?;
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| rustls::Error::General(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut cfg = builder.with_single_cert(vec![self.leaf.clone()], key)?;
        cfg.alpn_protocols = match alpn {
            Alpn::H2AndHttp1 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Alpn::Http1 => vec![b"http/1.1".to_vec()],
        };
        Ok(cfg)
    }
}

/// What a TLS connection agreed on, put in each of its requests' extensions.
#[derive(Debug, Clone)]
struct ConnMeta {
    tls_version: Option<String>,
    alpn: Option<String>,
}

type Log = Arc<Mutex<Vec<Negotiated>>>;

/// A running server of a fake: where it listens, how, and what each request arrived over.
pub(crate) struct Running {
    addr: SocketAddr,
    ca: Option<TestCa>,
    log: Log,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Running {
    /// The socket address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>` or `https://127.0.0.1:<port>`.
    pub(crate) fn origin(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The CA of a TLS server.
    pub(crate) fn ca(&self) -> Option<&TestCa> {
        self.ca.as_ref()
    }

    /// What every request so far arrived over, in arrival order.
    pub(crate) fn negotiated(&self) -> Vec<Negotiated> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

async fn record(State(log): State<Log>, req: Request, next: Next) -> Response {
    let meta = req.extensions().get::<ConnMeta>().cloned();
    let n = Negotiated {
        method: req.method().to_string(),
        path: req.uri().path().to_owned(),
        tls_version: meta.as_ref().and_then(|m| m.tls_version.clone()),
        alpn: meta.and_then(|m| m.alpn),
        http_version: format!("{:?}", req.version()),
    };
    if let Ok(mut l) = log.lock() {
        l.push(n);
    }
    next.run(req).await
}

/// Any axum app served the way the fakes are ([`serve_router`]): for a test's own server that
/// must speak TLS (an OTLP collector over `https://`, a gRPC service behind ALPN `h2`).
/// Dropping it stops the server and ends its connections.
pub struct Served(Running);

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served").field("origin", &self.origin()).finish()
    }
}

impl Served {
    /// `http://127.0.0.1:<port>`, or `https://127.0.0.1:<port>` when served over TLS.
    pub fn origin(&self) -> String {
        self.0.origin()
    }

    /// The CA the TLS certificate chains to (`None` over plain HTTP).
    pub fn ca(&self) -> Option<&TestCa> {
        self.0.ca()
    }

    /// What every request so far arrived over, in arrival order.
    pub fn negotiated(&self) -> Vec<Negotiated> {
        self.0.negotiated()
    }
}

/// Serves `app` on a random 127.0.0.1 port as `how` says (plain HTTP/1.1, or TLS with a fresh
/// CA and HTTP/2 or HTTP/1.1 by ALPN), as the fakes are served.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use tether_testkit::{Serve, server::serve_router};
/// let app = axum::Router::new().route("/", axum::routing::get(|| async { "hi" }));
/// let served = serve_router(app, &Serve::tls()).await.expect("bind 127.0.0.1");
/// assert!(served.origin().starts_with("https://127.0.0.1:"));
/// assert!(served.ca().is_some());
/// # }
/// ```
pub async fn serve_router(app: Router, how: &Serve) -> std::io::Result<Served> {
    serve(app, how).await.map(Served)
}

/// Serves `app` on a random 127.0.0.1 port as `serve` says.
pub(crate) async fn serve(app: Router, serve: &Serve) -> std::io::Result<Running> {
    // A deep accept queue: benchmarks open 1,000 connections at once, and the default
    // backlog (128) makes the kernel drop the excess, which the clients retry a second later.
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let listener = socket.listen(4096)?;
    let addr = listener.local_addr()?;
    let log: Log = Arc::default();
    let app = app.layer(axum::middleware::from_fn_with_state(log.clone(), record));
    let Some(alpn) = serve.tls else {
        // TCP_NODELAY, as real servers set it: without it a small write waits for the ACK of the
        // previous one, which the client may delay by 40 ms (Nagle + delayed ACK), and a short
        // stream takes ~40 ms for nothing.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("tether-testkit server stopped: {e}");
            }
        });
        return Ok(Running {
            addr,
            ca: None,
            log,
            task,
        });
    };
    let ca = TestCa::generate();
    let cfg = ca
        .server_config(alpn, serve.client_auth)
        .map_err(std::io::Error::other)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let task = tokio::spawn(accept_tls(listener, acceptor, app));
    Ok(Running {
        addr,
        ca: Some(ca),
        log,
        task,
    })
}

/// Accepts TCP connections, each handshaking and serving in its own task; aborting this task
/// (dropping the fake) ends every connection it accepted.
async fn accept_tls(listener: tokio::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor, app: Router) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                eprintln!("tether-testkit TLS server: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        conns.spawn(serve_tls(tcp, acceptor.clone(), app.clone()));
    }
}

async fn serve_tls(tcp: tokio::net::TcpStream, acceptor: tokio_rustls::TlsAcceptor, app: Router) {
    // A client that refuses the certificate ends the handshake with an alert: nothing to serve.
    let Ok(tls) = acceptor.accept(tcp).await else {
        return;
    };
    let (_, conn) = tls.get_ref();
    let meta = ConnMeta {
        tls_version: conn.protocol_version().map(|v| format!("{v:?}")),
        alpn: conn
            .alpn_protocol()
            .map(|p| String::from_utf8_lossy(p).into_owned()),
    };
    let h2 = meta.alpn.as_deref() == Some("h2");
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(meta.clone());
        let mut app = app.clone();
        tower_service::Service::call(&mut app, req)
    });
    let io = hyper_util::rt::TokioIo::new(tls);
    // Errors here are the client going away or a stream reset: the connection just ends.
    if h2 {
        let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(io, svc)
            .await;
    } else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, svc)
            .await;
    }
}
