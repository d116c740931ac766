//! OTLP over HTTP: the HTTP client the exporters use, and the wrapper that turns export
//! failures into one warning.

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

/// Reports an exporter's first failure as one warning (naming the endpoint) and the others not
/// at all: a collector that is down must not flood the terminal, nor stop the run.
#[derive(Debug)]
pub(crate) struct Quiet<E> {
    pub(crate) inner: E,
    pub(crate) endpoint: String,
    pub(crate) warned: Arc<AtomicBool>,
}

impl<E> Quiet<E> {
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
        let r = self.inner.export(batch).await;
        if let Err(e) = &r {
            self.report("traces", e);
        }
        r
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

impl<E: PushMetricExporter> PushMetricExporter for Quiet<E> {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let r = self.inner.export(metrics).await;
        if let Err(e) = &r {
            self.report("metrics", e);
        }
        r
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}
