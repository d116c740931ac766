//! OTLP export: the HTTP client the exporters use, the gRPC exporters' setup, and the wrapper
//! that turns export failures into one warning.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::Temporality;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};

/// The largest collector response read (the OTLP response is a few bytes; a partial-success
/// message at most a few KiB).
const MAX_RESPONSE: usize = 1 << 20;

/// Sends the exporters' requests with tether's reqwest (rustls, the platform's roots and the
/// extra ones given), on a small runtime of its own: the SDK's batch processors export from a
/// plain thread, where a request cannot be driven by the application's runtime.
#[derive(Debug, Clone)]
pub(crate) struct ExportClient {
    http: reqwest::Client,
    rt: tokio::runtime::Handle,
}

impl ExportClient {
    pub(crate) fn new(
        rt: tokio::runtime::Handle,
        timeout: Duration,
        tls: &Tls,
    ) -> Result<Self, tether::Error> {
        let mut http = reqwest::Client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .timeout(timeout);
        if let Some(ca) = &tls.ca {
            for cert in ca.certificates()? {
                http = http.add_root_certificate(cert);
            }
        }
        if let Some(id) = &tls.identity {
            http = http.identity(id.reqwest()?);
        }
        let http = http.build().map_err(|e| {
            tether::Error::config_with(tether::ConfigKind::Setup, "cannot build the OTLP HTTP client", e)
        })?;
        Ok(ExportClient { http, rt })
    }
}

/// The largest certificate or key file read (a CA bundle is a few hundred KiB at most).
const MAX_PEM: u64 = 4 << 20;

/// TLS for one signal's exporter beyond the webpki roots: the CAs a collector with a private
/// CA is trusted by, and the client certificate a collector asking for mutual TLS is shown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Tls {
    pub(crate) ca: Option<Pem>,
    pub(crate) identity: Option<ClientIdentity>,
}

/// PEM bytes and where they came from (a variable and its path, or the `ExportConfig` method),
/// for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pem {
    pub(crate) from: String,
    pub(crate) bytes: Vec<u8>,
}

/// A client certificate chain and its private key, both PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClientIdentity {
    pub(crate) cert: Pem,
    pub(crate) key: Pem,
}

fn invalid(msg: String) -> tether::Error {
    tether::Error::config(tether::ConfigKind::Invalid, msg)
}

impl Pem {
    /// Reads the file `path` that variable `var` names: bounded, and an error naming both when
    /// it cannot be read.
    pub(crate) fn read(var: &str, path: &str) -> Result<Pem, tether::Error> {
        use std::io::Read;
        let from = format!("{var}={path}");
        let mut bytes = Vec::new();
        // One read, bounded: at most one byte past the limit, to tell an oversized file.
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_PEM + 1).read_to_end(&mut bytes))
            .map_err(|e| {
                tether::Error::config_with(
                    tether::ConfigKind::Invalid,
                    format!("{from}: cannot read the file"),
                    e,
                )
            })?;
        if bytes.len() as u64 > MAX_PEM {
            return Err(invalid(format!(
                "{from}: the file is larger than a PEM file holds ({MAX_PEM} bytes at most)"
            )));
        }
        Ok(Pem { from, bytes })
    }

    /// The certificates in it: an error when it holds none or one that does not parse.
    pub(crate) fn certificates(&self) -> Result<Vec<reqwest::Certificate>, tether::Error> {
        match reqwest::Certificate::from_pem_bundle(&self.bytes) {
            Ok(certs) if !certs.is_empty() => Ok(certs),
            Ok(_) => Err(invalid(format!("{}: holds no PEM certificate", self.from))),
            Err(e) => Err(tether::Error::config_with(
                tether::ConfigKind::Invalid,
                format!("{}: not a PEM certificate bundle", self.from),
                e,
            )),
        }
    }
}

impl ClientIdentity {
    /// The certificate and key as reqwest's identity (one PEM holding both): an error naming
    /// the files when they do not parse.
    pub(crate) fn reqwest(&self) -> Result<reqwest::Identity, tether::Error> {
        let mut both = self.cert.bytes.clone();
        both.push(b'\n');
        both.extend_from_slice(&self.key.bytes);
        reqwest::Identity::from_pem(&both).map_err(|e| {
            tether::Error::config_with(
                tether::ConfigKind::Invalid,
                format!(
                    "{} and {}: not a PEM client certificate and its private key",
                    self.cert.from, self.key.from
                ),
                e,
            )
        })
    }
}

impl Tls {
    /// Checks that what is given parses, so a bad file is a configuration error at start and
    /// not a failed export later.
    pub(crate) fn check(&self) -> Result<(), tether::Error> {
        if let Some(ca) = &self.ca {
            ca.certificates()?;
        }
        if let Some(id) = &self.identity {
            id.reqwest()?;
        }
        Ok(())
    }
}

#[async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let http = self.http.clone();
        let task = self.rt.spawn(async move {
            let mut rb = http.request(parts.method, parts.uri.to_string()).body(body);
            for (k, v) in &parts.headers {
                rb = rb.header(k, v);
            }
            let mut resp = rb.send().await?;
            let status = resp.status();
            let mut out = Vec::new();
            while let Some(c) = resp.chunk().await? {
                if out.len() + c.len() > MAX_RESPONSE {
                    break;
                }
                out.extend_from_slice(&c);
            }
            let mut r = Response::builder().status(status);
            if let Some(h) = r.headers_mut() {
                *h = resp.headers().clone();
            }
            Ok::<_, HttpError>(r.body(Bytes::from(out))?)
        });
        task.await.map_err(|e| Box::new(e) as HttpError)?
    }
}

/// Configures an OTLP/HTTP exporter's builder as `b` says: tether's client, protobuf bodies, the
/// timeout, the endpoint (`{base}{path}`, when not the environment's) and the headers.
pub(crate) fn http<T>(
    builder: T,
    b: &crate::Build,
    headers: &std::collections::HashMap<String, String>,
    client: &ExportClient,
    path: &str,
) -> T
where
    T: opentelemetry_otlp::WithExportConfig + opentelemetry_otlp::WithHttpConfig,
{
    let mut builder = builder
        .with_http_client(client.clone())
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_timeout(b.timeout);
    if let Some(base) = &b.endpoint {
        builder = builder.with_endpoint(format!("{base}{path}"));
    }
    if !headers.is_empty() {
        builder = builder.with_headers(headers.clone());
    }
    builder
}

/// Configures a gRPC exporter's builder as `b` says: its endpoint (when not the environment's),
/// timeout, headers as gRPC metadata, and TLS: the webpki roots, the extra CAs and the client
/// identity of `tls`.
///
/// The TLS configuration is given whatever the endpoint: tonic uses it only for an `https://`
/// one, and the endpoint the SDK ends up with may be another than `b`'s (a signal's own
/// `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`, or one without a scheme, which it makes `https://`).
#[cfg(feature = "grpc")]
pub(crate) fn grpc<T>(
    builder: T,
    b: &crate::Build,
    headers: &std::collections::HashMap<String, String>,
    tls: &Tls,
) -> Result<T, tether::Error>
where
    T: opentelemetry_otlp::WithExportConfig + opentelemetry_otlp::WithTonicConfig,
{
    use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
    let mut builder = builder.with_timeout(b.timeout);
    if let Some(base) = &b.endpoint {
        builder = builder.with_endpoint(base.clone());
    }
    tls.check()?;
    let mut config = tonic::transport::ClientTlsConfig::new().with_webpki_roots();
    if let Some(ca) = &tls.ca {
        config = config.ca_certificate(tonic::transport::Certificate::from_pem(&ca.bytes));
    }
    if let Some(id) = &tls.identity {
        config = config.identity(tonic::transport::Identity::from_pem(
            &id.cert.bytes,
            &id.key.bytes,
        ));
    }
    builder = builder.with_tls_config(config);
    if !headers.is_empty() {
        let mut m = MetadataMap::with_capacity(headers.len());
        for (k, v) in headers {
            let bad = |what: &str| {
                tether::Error::config(
                    tether::ConfigKind::Invalid,
                    format!("the OTLP header {k:?} cannot be sent as gRPC metadata: {what}"),
                )
            };
            let key = MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
                .map_err(|_| bad("not a valid name"))?;
            let value =
                MetadataValue::try_from(v.as_str()).map_err(|_| bad("its value is not printable ASCII"))?;
            m.insert(key, value);
        }
        builder = builder.with_metadata(m);
    }
    Ok(builder)
}

/// Reports an exporter's first failure as one warning (naming the endpoint) and the others not
/// at all: a collector that is down must not flood the terminal, nor stop the run.
#[derive(Debug)]
pub(crate) struct Quiet<E> {
    pub(crate) inner: E,
    pub(crate) endpoint: String,
    pub(crate) warned: Arc<AtomicBool>,
    /// The export runtime, entered while an export runs (the SDK exports from a plain thread;
    /// gRPC's timers and connection, and the HTTP span export's retry timer, need a Tokio
    /// context).
    pub(crate) rt: Option<tokio::runtime::Handle>,
}

/// `fut`, polled inside `rt`'s context.
struct Entered<'a, F> {
    rt: &'a tokio::runtime::Handle,
    fut: std::pin::Pin<Box<F>>,
}

impl<F: std::future::Future> std::future::Future for Entered<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = &mut *self;
        let _in = this.rt.enter();
        this.fut.as_mut().poll(cx)
    }
}

impl<E> Quiet<E> {
    pub(crate) fn new(inner: E, endpoint: &str, warned: &Arc<AtomicBool>) -> Self {
        Quiet {
            inner,
            endpoint: endpoint.to_owned(),
            warned: warned.clone(),
            rt: None,
        }
    }

    /// Runs the exports inside `rt`'s context.
    pub(crate) fn in_runtime(mut self, rt: tokio::runtime::Handle) -> Self {
        self.rt = Some(rt);
        self
    }

    /// Awaits `fut`, inside the export runtime's context when there is one.
    async fn run<F: std::future::Future>(&self, fut: F) -> F::Output {
        match &self.rt {
            Some(rt) => {
                Entered {
                    rt,
                    fut: Box::pin(fut),
                }
                .await
            }
            None => fut.await,
        }
    }

    fn report(&self, what: &str, e: &dyn std::fmt::Display) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tether_otel",
                "could not export {what} to {}: {e}; the run goes on, and later export failures are not reported",
                self.endpoint
            );
        }
    }
}

impl<E: SpanExporter> SpanExporter for Quiet<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let r = self.run(self.inner.export(batch)).await;
        if let Err(e) = &r {
            self.report("traces", e);
        }
        r
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _in = self.rt.as_ref().map(|rt| rt.enter());
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        let _in = self.rt.as_ref().map(|rt| rt.enter());
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

impl<E: PushMetricExporter> PushMetricExporter for Quiet<E> {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let r = self.run(self.inner.export(metrics)).await;
        if let Err(e) = &r {
            self.report("metrics", e);
        }
        r
    }

    fn force_flush(&self) -> OTelSdkResult {
        let _in = self.rt.as_ref().map(|rt| rt.enter());
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _in = self.rt.as_ref().map(|rt| rt.enter());
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}
