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
    pub(crate) fn new(rt: tokio::runtime::Handle, timeout: Duration) -> Result<Self, tether::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .timeout(timeout)
            .build()
            .map_err(|e| {
                tether::Error::config_with(tether::ConfigKind::Setup, "cannot build the OTLP HTTP client", e)
            })?;
        Ok(ExportClient { http, rt })
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
/// timeout, headers as gRPC metadata, and TLS with the webpki roots for an `https://` endpoint.
#[cfg(feature = "grpc")]
pub(crate) fn grpc<T>(
    builder: T,
    b: &crate::Build,
    headers: &std::collections::HashMap<String, String>,
) -> Result<T, tether::Error>
where
    T: opentelemetry_otlp::WithExportConfig + opentelemetry_otlp::WithTonicConfig,
{
    use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
    let mut builder = builder.with_timeout(b.timeout);
    if let Some(base) = &b.endpoint {
        builder = builder.with_endpoint(base.clone());
    }
    if b.shown.starts_with("https://") {
        builder = builder.with_tls_config(tonic::transport::ClientTlsConfig::new().with_webpki_roots());
    }
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
    /// The export runtime, entered while an export runs (gRPC: tonic's timers and connection
    /// need a Tokio context, and the SDK exports from a plain thread).
    pub(crate) rt: Option<tokio::runtime::Handle>,
}

/// `fut`, polled inside `rt`'s context (gRPC exports only: the HTTP ones are awaited as they are).
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
    #[cfg(feature = "grpc")]
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
