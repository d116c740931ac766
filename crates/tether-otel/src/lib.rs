//! # tether-otel
//!
//! OpenTelemetry traces and metrics for tether sessions, by the GenAI semantic conventions
//! (pinned: v1.41.0, see [`semconv`]), built from the session's events — so every provider, the
//! local loop as much as Claude Managed Agents, Bedrock AgentCore or an ACP agent, gets the same
//! spans:
//!
//! - `invoke_agent {agent}` per request (kind `INTERNAL` for the local loop, `CLIENT` for remote
//!   loops), linked to the session's previous request (after a restart too);
//! - `chat {model}` per model call, with the request and response model, response id, finish
//!   reasons and token usage;
//! - `execute_tool {tool}` per tool call, with the tool's name, type and call id, and the MCP
//!   attributes for an MCP tool;
//! - `error.type` on every span of a request that failed, was cancelled or timed out, and on a
//!   failed tool; retries and reconnects as span events; content only when opted in.
//!
//! Metrics: `gen_ai.client.operation.duration` and `gen_ai.client.token.usage`.
//!
//! [`Telemetry::from_env`] sets up OTLP export (HTTP/protobuf, or gRPC) from the standard
//! `OTEL_*` variables (none set: nothing, at no cost); [`Tracer`] makes each session's observer
//! ([`tether::SessionBuilder::observer`], [`Tracer::attach`]). [`Telemetry::tracer`] builds the
//! spans directly on the OpenTelemetry SDK; a tracer given a `tracing` dispatcher
//! ([`Tracer::with_dispatch`]), or made by [`Tracer::new`], makes `tracing` spans bridged by
//! `tracing-opentelemetry` instead, so a `tracing` setup sees the same tree.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> tether::Result<()> {
//! use tether::{Session, ScriptedModel, local::LocalLoop};
//! use tracing_subscriber::prelude::*;
//!
//! let telemetry = tether_otel::Telemetry::from_env()?; // None: OTEL_EXPORTER_OTLP_ENDPOINT unset
//! tracing_subscriber::registry()
//!     .with(telemetry.as_ref().map(|t| t.layer()))
//!     .try_init()
//!     .ok(); // a global subscriber may be set already
//! let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("hi"))]);
//! let mut builder = Session::builder(LocalLoop::new(model));
//! if let Some(t) = &telemetry {
//!     builder = builder.observer(t.tracer().agent_name("helper").observer());
//! }
//! let result = builder.run("hi").await?;
//! assert_eq!(result.text, "hi");
//! if let Some(t) = telemetry {
//!     t.shutdown();
//! }
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod export;
mod observer;
mod otlp;
pub mod semconv;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tether::Error;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

pub use observer::{STATE_KEY, SessionTracer, TARGET, Tracer};

static GLOBAL: std::sync::OnceLock<Tracer> = std::sync::OnceLock::new();

/// Makes `tracer` the process's tracer: the one `tether run` and `tether serve` trace sessions
/// with. Only the first call counts; returns whether this one did.
pub fn set_global_tracer(tracer: Tracer) -> bool {
    GLOBAL.set(tracer).is_ok()
}

/// The process's tracer, when telemetry is on ([`set_global_tracer`]).
pub fn global_tracer() -> Option<&'static Tracer> {
    GLOBAL.get()
}

/// `builder` with an observer from the process's tracer when telemetry is on; unchanged (and
/// the session untraced, at no cost) when it is off.
pub fn observe_global(builder: tether::SessionBuilder) -> tether::SessionBuilder {
    match GLOBAL.get() {
        Some(t) => builder.observer(t.observer()),
        None => builder,
    }
}

/// Attaches the process's tracer, when telemetry is on, to an open session's sink, naming the
/// agent `agent` (see [`Tracer::attach`]); does nothing when it is off. Returns whether it
/// attached.
pub async fn attach_global(sink: &tether::EventSink, agent: &str) -> bool {
    match GLOBAL.get() {
        Some(t) => t.clone().agent_name(agent).attach(sink).await,
        None => false,
    }
}

/// For a binary: installs the global `tracing` subscriber — a log on stderr filtered by
/// `log_filter`, and, when the environment configures OTLP export ([`Telemetry::from_env`]),
/// the `tracing` bridge to it (for the application's own spans) — and the global tracer. Returns the telemetry, to
/// [`Telemetry::shutdown`] before exiting. A bad configuration is reported as one warning on
/// stderr, and the program runs untraced.
pub fn init(log_filter: tracing_subscriber::EnvFilter) -> Option<Telemetry> {
    use tracing_subscriber::prelude::*;
    let (telemetry, problem) = match Telemetry::from_env() {
        Ok(t) => (t, None),
        Err(e) => (None, Some(e)),
    };
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log_filter);
    let _ = tracing_subscriber::registry()
        .with(log)
        .with(telemetry.as_ref().map(|t| t.layer()))
        .try_init();
    if let Some(e) = problem {
        eprintln!("warning: OpenTelemetry export is off: {e}");
    }
    if let Some(t) = &telemetry {
        set_global_tracer(t.tracer());
    }
    telemetry
}

/// The environment variable that opts into content capture (`true`): messages, tool arguments
/// and results on the spans. The name most GenAI instrumentations read.
pub const CAPTURE_CONTENT_ENV: &str = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT";

/// The OTLP transport: what `OTEL_EXPORTER_OTLP_PROTOCOL` names.
///
/// ```
/// use tether_otel::OtlpProtocol;
/// assert_eq!(OtlpProtocol::parse("grpc"), Some(OtlpProtocol::Grpc));
/// assert_eq!(OtlpProtocol::parse("http/protobuf"), Some(OtlpProtocol::HttpProtobuf));
/// assert_eq!(OtlpProtocol::parse("http/json"), None); // not built in
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`, a collector's port 4318): the default.
    #[default]
    HttpProtobuf,
    /// OTLP/gRPC (`grpc`, a collector's port 4317). Needs the `grpc` feature (on by default).
    Grpc,
}

impl OtlpProtocol {
    /// The protocol an `OTEL_EXPORTER_OTLP_PROTOCOL` value names, or `None` for one not built
    /// in (`http/json`, a typo, `grpc` without the `grpc` feature).
    pub fn parse(s: &str) -> Option<OtlpProtocol> {
        match s.trim() {
            "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
            #[cfg(feature = "grpc")]
            "grpc" => Some(OtlpProtocol::Grpc),
            _ => None,
        }
    }
}

/// The protocol one signal (`TRACES`, `METRICS`) exports with: its own variable, else the
/// general one, else `http/protobuf`.
fn protocol_from_env(signal: &str) -> tether::Result<OtlpProtocol> {
    let var = format!("OTEL_EXPORTER_OTLP_{signal}_PROTOCOL");
    let (name, value) = match env(&var) {
        Some(v) => (var, v),
        None => match env("OTEL_EXPORTER_OTLP_PROTOCOL") {
            Some(v) => ("OTEL_EXPORTER_OTLP_PROTOCOL".to_owned(), v),
            None => return Ok(OtlpProtocol::HttpProtobuf),
        },
    };
    OtlpProtocol::parse(&value).ok_or_else(|| {
        let built = if cfg!(feature = "grpc") {
            "http/protobuf (a collector's port 4318) or grpc (port 4317)"
        } else {
            "http/protobuf only (a collector's port 4318; this build has no `grpc` feature)"
        };
        Error::config(
            tether::ConfigKind::Unsupported,
            format!("{name}={value} is not supported: tether exports OTLP over {built}"),
        )
    })
}

/// How to export, when not from the environment (tests, embedding applications).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ExportConfig {
    /// The collector's base URL. Over OTLP/HTTP (`http://127.0.0.1:4318`) traces go to
    /// `/v1/traces` and metrics to `/v1/metrics`; over gRPC (`http://127.0.0.1:4317`) the URL is
    /// the gRPC server's, used as it is. `https://` means TLS over either: the webpki roots, and
    /// [`ExportConfig::ca_certificate`] for a private CA.
    pub endpoint: String,
    /// The transport (default OTLP/HTTP with protobuf).
    pub protocol: OtlpProtocol,
    /// Extra request headers (an API key of a hosted collector).
    pub headers: Vec<(String, String)>,
    /// `service.name` (default `tether`).
    pub service_name: String,
    /// How long spans wait in the batch before export (default 5 s).
    pub batch_delay: Duration,
    /// How often metrics are exported (default 60 s).
    pub metrics_interval: Duration,
    /// Whether metrics are exported (default yes).
    pub metrics: bool,
    /// Whether content is recorded (default no).
    pub capture_content: bool,
    /// Per-export timeout (default 10 s).
    pub timeout: Duration,
    /// CA certificates (PEM) trusted beside the webpki roots: a collector whose certificate a
    /// private CA signed ([`ExportConfig::ca_certificate`]).
    pub ca_certificate: Option<Vec<u8>>,
    /// A client certificate chain and its private key (both PEM), shown to a collector that
    /// asks for mutual TLS ([`ExportConfig::client_identity`]).
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ExportConfig {
    /// Export to the collector at `endpoint`, with the defaults (OTLP/HTTP; see
    /// [`ExportConfig::protocol`]).
    pub fn new(endpoint: impl Into<String>) -> Self {
        ExportConfig {
            endpoint: endpoint.into(),
            protocol: OtlpProtocol::HttpProtobuf,
            headers: Vec::new(),
            service_name: "tether".into(),
            batch_delay: Duration::from_secs(5),
            metrics_interval: Duration::from_secs(60),
            metrics: true,
            capture_content: false,
            timeout: Duration::from_secs(10),
            ca_certificate: None,
            client_identity: None,
        }
    }

    /// Trusts the CA certificates in `pem` (one or more PEM `CERTIFICATE` blocks) beside the
    /// webpki roots, for an `https://` collector whose certificate a private CA signed: what
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE` names in the environment. Over both transports.
    ///
    /// ```
    /// # fn f(pem: Vec<u8>) {
    /// let c = tether_otel::ExportConfig::new("https://collector.internal:4318").ca_certificate(pem);
    /// assert!(c.ca_certificate.is_some());
    /// # }
    /// ```
    pub fn ca_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_certificate = Some(pem.into());
        self
    }

    /// Shows the client certificate chain `cert` with its private key `key` (both PEM) to a
    /// collector that asks for mutual TLS: what `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and
    /// `OTEL_EXPORTER_OTLP_CLIENT_KEY` name in the environment.
    pub fn client_identity(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.client_identity = Some((cert.into(), key.into()));
        self
    }

    /// The transport: OTLP/HTTP (the default) or gRPC.
    ///
    /// ```
    /// use tether_otel::{ExportConfig, OtlpProtocol};
    /// let c = ExportConfig::new("http://127.0.0.1:4317").protocol(OtlpProtocol::Grpc);
    /// assert_eq!(c.protocol, OtlpProtocol::Grpc);
    /// ```
    pub fn protocol(mut self, p: OtlpProtocol) -> Self {
        self.protocol = p;
        self
    }

    /// How long spans wait in the batch before export.
    pub fn batch_delay(mut self, d: Duration) -> Self {
        self.batch_delay = d;
        self
    }

    /// How often metrics are exported.
    pub fn metrics_interval(mut self, d: Duration) -> Self {
        self.metrics_interval = d;
        self
    }

    /// Whether content is recorded.
    pub fn capture_content(mut self, on: bool) -> Self {
        self.capture_content = on;
        self
    }

    /// `service.name`.
    pub fn service_name(mut self, name: impl Into<String>) -> Self {
        self.service_name = name.into();
        self
    }
}

/// OTLP export of traces and metrics (HTTP/protobuf or gRPC): the SDK providers, the [`Tracer`]
/// that builds tether's spans on them ([`Telemetry::tracer`]), and the `tracing` layer that
/// bridges `tracing` spans into them ([`Telemetry::layer`]). Dropping it without
/// [`Telemetry::shutdown`] loses what is still batched.
pub struct Telemetry {
    traces: SdkTracerProvider,
    metrics: Option<SdkMeterProvider>,
    capture_content: bool,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("metrics", &self.metrics.is_some())
            .field("capture_content", &self.capture_content)
            .finish()
    }
}

fn env(k: &str) -> Option<String> {
    std::env::var(k)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

fn env_true(k: &str) -> bool {
    env(k).is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

impl Telemetry {
    /// Export as the standard environment variables say, or `None` when they configure nothing:
    /// on when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set,
    /// unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Also read:
    /// `OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_HEADERS` and `_TIMEOUT`, `OTEL_SERVICE_NAME`
    /// (default `tether`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`,
    /// `OTEL_BSP_*`, `OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_METRICS_EXPORTER=none` (no metrics),
    /// and [`CAPTURE_CONTENT_ENV`].
    ///
    /// `OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_PROTOCOL` chooses the transport: `http/protobuf`
    /// (the default) or `grpc` ([`OtlpProtocol`]).
    ///
    /// TLS (an `https://` endpoint) trusts the webpki roots, and also the CA certificates of the
    /// PEM file `OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_CERTIFICATE` names; for mutual TLS,
    /// `OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_CLIENT_CERTIFICATE` and `_CLIENT_KEY` name the
    /// client's certificate chain and private key (PEM). A signal's own variable wins over the
    /// general one.
    ///
    /// Errors: [`Error::Config`] for a protocol not built in (`http/json`; `grpc` without the
    /// `grpc` feature), a malformed endpoint, or a certificate or key file that cannot be read
    /// or parsed, or a client certificate without its key (or the reverse).
    pub fn from_env() -> tether::Result<Option<Telemetry>> {
        if env_true("OTEL_SDK_DISABLED") || env("OTEL_TRACES_EXPORTER").as_deref() == Some("none") {
            return Ok(None);
        }
        let Some(endpoint) =
            env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
        else {
            return Ok(None);
        };
        let traces_protocol = protocol_from_env("TRACES")?;
        let metrics = env("OTEL_METRICS_EXPORTER").as_deref() != Some("none");
        let metrics_protocol = match metrics {
            true => protocol_from_env("METRICS")?,
            false => traces_protocol,
        };
        let timeout = env("OTEL_EXPORTER_OTLP_TIMEOUT")
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(Duration::from_secs(10));
        let traces_tls = tls_from_env("TRACES")?;
        let metrics_tls = match metrics {
            true => tls_from_env("METRICS")?,
            false => export::Tls::default(),
        };
        let service = match (env("OTEL_SERVICE_NAME"), env("OTEL_RESOURCE_ATTRIBUTES")) {
            (Some(_), _) => None,
            (None, Some(a)) if a.split(',').any(|kv| kv.trim().starts_with("service.name=")) => None,
            _ => Some("tether".to_owned()),
        };
        Self::build(Build {
            endpoint: None,
            traces_protocol,
            metrics_protocol,
            shown_metrics: env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
                .unwrap_or_else(|| {
                    // Where the SDK sends metrics when no endpoint names it: the OTLP default.
                    match metrics_protocol {
                        OtlpProtocol::Grpc => "http://localhost:4317".to_owned(),
                        _ => "http://localhost:4318".to_owned(),
                    }
                }),
            shown: endpoint,
            headers: Vec::new(),
            service,
            batch_delay: None,
            metrics_interval: None,
            metrics,
            capture_content: env_true(CAPTURE_CONTENT_ENV),
            timeout,
            traces_tls,
            metrics_tls,
        })
        .map(Some)
    }

    /// Export to the collector `config` names (the environment's endpoint and headers are not
    /// read).
    pub fn new(config: ExportConfig) -> tether::Result<Telemetry> {
        let base = config.endpoint.trim_end_matches('/').to_owned();
        let given = |bytes: &Vec<u8>, what: &str| export::Pem {
            from: format!("ExportConfig::{what}"),
            bytes: bytes.clone(),
        };
        let tls = export::Tls {
            ca: config.ca_certificate.as_ref().map(|p| given(p, "ca_certificate")),
            identity: config
                .client_identity
                .as_ref()
                .map(|(c, k)| export::ClientIdentity {
                    cert: given(c, "client_identity (certificate)"),
                    key: given(k, "client_identity (key)"),
                }),
        };
        Self::build(Build {
            endpoint: Some(base.clone()),
            traces_protocol: config.protocol,
            metrics_protocol: config.protocol,
            shown_metrics: base.clone(),
            shown: base,
            headers: config.headers,
            service: Some(config.service_name),
            batch_delay: Some(config.batch_delay),
            metrics_interval: Some(config.metrics_interval),
            metrics: config.metrics,
            capture_content: config.capture_content,
            timeout: config.timeout,
            traces_tls: tls.clone(),
            metrics_tls: tls,
        })
    }

    fn build(b: Build) -> tether::Result<Telemetry> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tether-otel-export")
            .enable_all()
            .build()
            .map_err(|e| {
                Error::config_with(
                    tether::ConfigKind::Setup,
                    "cannot start the OTLP export thread",
                    e,
                )
            })?;
        match Self::providers(&runtime, &b) {
            Ok((traces, metrics)) => Ok(Telemetry {
                traces,
                metrics,
                capture_content: b.capture_content,
                runtime: Some(runtime),
            }),
            Err(e) => {
                // Never block (nor panic: this may be an async context) dropping the runtime.
                runtime.shutdown_background();
                Err(e)
            }
        }
    }

    /// The tracer and meter providers exporting as `b` says, on `runtime`.
    fn providers(
        runtime: &tokio::runtime::Runtime,
        b: &Build,
    ) -> tether::Result<(SdkTracerProvider, Option<SdkMeterProvider>)> {
        #[cfg(not(feature = "grpc"))]
        if b.traces_protocol == OtlpProtocol::Grpc || (b.metrics && b.metrics_protocol == OtlpProtocol::Grpc)
        {
            return Err(Error::config(
                tether::ConfigKind::Unsupported,
                "OTLP over gRPC needs tether-otel's `grpc` feature, which this build leaves out",
            ));
        }
        let client = |tls: &export::Tls| export::ExportClient::new(runtime.handle().clone(), b.timeout, tls);
        let mut resource = Resource::builder();
        if let Some(s) = &b.service {
            resource = resource.with_service_name(s.clone());
        }
        let resource = resource.build();
        let warned = Arc::new(AtomicBool::new(false));
        let headers: std::collections::HashMap<String, String> = b.headers.iter().cloned().collect();
        let bad = |e: opentelemetry_otlp::ExporterBuildError| {
            Error::config_with(tether::ConfigKind::Setup, "OTLP exporter", e)
        };

        let mut batch = BatchConfigBuilder::default();
        if let Some(d) = b.batch_delay {
            batch = batch.with_scheduled_delay(d);
        }
        let batch = batch.build();
        let processor = match b.traces_protocol {
            #[cfg(feature = "grpc")]
            OtlpProtocol::Grpc => {
                // The gRPC channel's connection task lives on the export runtime.
                let _in = runtime.enter();
                let s = export::grpc(
                    opentelemetry_otlp::SpanExporter::builder().with_tonic(),
                    b,
                    &headers,
                    &b.traces_tls,
                )?;
                let s = export::Quiet::new(s.build().map_err(bad)?, &b.shown, &warned)
                    .in_runtime(runtime.handle().clone());
                BatchSpanProcessor::builder(s).with_batch_config(batch).build()
            }
            _ => {
                let (endpoint, headers) = traces_http_target(b)?;
                let s = otlp::HttpSpans::new(client(&b.traces_tls)?, &endpoint, &headers, b.timeout)?;
                // In the export runtime: a retry waits on its timer.
                let s = export::Quiet::new(s, &b.shown, &warned).in_runtime(runtime.handle().clone());
                BatchSpanProcessor::builder(s).with_batch_config(batch).build()
            }
        };
        let traces = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.clone())
            .build();

        let metrics = if b.metrics {
            let exporter = match b.metrics_protocol {
                #[cfg(feature = "grpc")]
                OtlpProtocol::Grpc => {
                    let _in = runtime.enter();
                    let m = export::grpc(
                        opentelemetry_otlp::MetricExporter::builder().with_tonic(),
                        b,
                        &headers,
                        &b.metrics_tls,
                    )?;
                    export::Quiet::new(m.build().map_err(bad)?, &b.shown_metrics, &warned)
                        .in_runtime(runtime.handle().clone())
                }
                _ => {
                    let m = export::http(
                        opentelemetry_otlp::MetricExporter::builder().with_http(),
                        b,
                        &headers,
                        &client(&b.metrics_tls)?,
                        "/v1/metrics",
                    );
                    export::Quiet::new(m.build().map_err(bad)?, &b.shown_metrics, &warned)
                }
            };
            let mut reader = PeriodicReader::builder(exporter);
            if let Some(d) = b.metrics_interval {
                reader = reader.with_interval(d);
            }
            Some(
                SdkMeterProvider::builder()
                    .with_reader(reader.build())
                    .with_resource(resource)
                    .build(),
            )
        } else {
            None
        };
        Ok((traces, metrics))
    }

    /// The `tracing` layer that turns `tracing` spans of target [`TARGET`] into OpenTelemetry
    /// spans exported by this telemetry: those of a [`Tracer`] given a dispatcher
    /// ([`Tracer::with_dispatch`]) or made by [`Tracer::new`]. A tracer from
    /// [`Telemetry::tracer`] does not need it (it builds its spans on the SDK directly). Add it
    /// to the application's subscriber.
    pub fn layer<S>(&self) -> impl Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.traces.tracer("tether"))
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_level(false)
            .with_target(false)
            .with_filter(tracing_subscriber::filter::filter_fn(|m| m.target() == TARGET))
    }

    /// A dispatcher holding only [`Telemetry::layer`]: for a [`Tracer`] whose spans must reach
    /// this telemetry whatever the global subscriber is (tests, embedding).
    pub fn dispatch(&self) -> tracing::Dispatch {
        use tracing_subscriber::prelude::*;
        tracing::Dispatch::new(tracing_subscriber::registry().with(self.layer()))
    }

    /// A [`Tracer`] recording this telemetry's metrics, with content as configured, that builds
    /// its spans directly on this telemetry's OpenTelemetry SDK tracer: no `tracing` span, no
    /// `tracing` subscriber needed. A request span with no other parent is a child of the
    /// OpenTelemetry span of the current `tracing` span, when it has one (with
    /// [`Telemetry::layer`] or another `tracing-opentelemetry` layer installed).
    ///
    /// For `tracing` spans bridged through a dispatcher instead (so that other `tracing` layers
    /// see them), give it one with [`Tracer::with_dispatch`] ([`Telemetry::dispatch`], or a
    /// subscriber holding [`Telemetry::layer`]).
    pub fn tracer(&self) -> Tracer {
        let mut t = Tracer::new()
            .with_sdk_tracer(self.traces.tracer("tether"))
            .capture_content(self.capture_content);
        if let Some(m) = &self.metrics {
            use opentelemetry::metrics::MeterProvider as _;
            t = t.with_meter(&m.meter("tether"));
        }
        t
    }

    /// Exports what is batched now (bounded by the export timeout).
    pub fn flush(&self) {
        let _ = self.traces.force_flush();
        if let Some(m) = &self.metrics {
            let _ = m.force_flush();
        }
    }

    /// Exports what is batched and stops, waiting at most 5 s: a collector that is down or
    /// hangs cannot hold the process.
    pub fn shutdown(mut self) {
        let traces = self.traces.clone();
        let metrics = self.metrics.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("tether-otel-shutdown".into())
            .spawn(move || {
                let _ = traces.shutdown_with_timeout(Duration::from_secs(4));
                if let Some(m) = metrics {
                    let _ = m.shutdown_with_timeout(Duration::from_secs(4));
                }
                let _ = tx.send(());
            });
        if spawned.is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        // Never block (nor panic inside an async context) on drop.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

struct Build {
    endpoint: Option<String>,
    traces_protocol: OtlpProtocol,
    metrics_protocol: OtlpProtocol,
    shown: String,
    /// The metrics collector, as warnings name it (its own variable's, else the general one).
    shown_metrics: String,
    headers: Vec<(String, String)>,
    service: Option<String>,
    batch_delay: Option<Duration>,
    metrics_interval: Option<Duration>,
    metrics: bool,
    capture_content: bool,
    timeout: Duration,
    /// TLS beyond the webpki roots, per signal (each may name its own files).
    traces_tls: export::Tls,
    metrics_tls: export::Tls,
}

/// Where OTLP/HTTP spans go and the headers they carry: `b`'s endpoint with `/v1/traces` and its
/// headers when given in code; else, as the OTLP exporter specification says,
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, or `OTEL_EXPORTER_OTLP_ENDPOINT` with
/// `/v1/traces`, or `http://localhost:4318/v1/traces`, with the headers of
/// `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else of `OTEL_EXPORTER_OTLP_HEADERS`.
///
/// Errors: a compression asked for (`OTEL_EXPORTER_OTLP[_TRACES]_COMPRESSION`, other than
/// `none`), which this build does not do; a header list entry that is not `key=value` with a
/// percent-encoded UTF-8 value.
fn traces_http_target(b: &Build) -> tether::Result<(String, Vec<(String, String)>)> {
    let join = |base: &str| format!("{}/v1/traces", base.trim_end_matches('/'));
    if let Some(base) = &b.endpoint {
        return Ok((join(base), b.headers.clone()));
    }
    if let Some(c) =
        env("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION").or_else(|| env("OTEL_EXPORTER_OTLP_COMPRESSION"))
        && c.trim() != "none"
    {
        return Err(Error::config(
            tether::ConfigKind::Unsupported,
            format!(
                "OTLP compression {c:?} is not built into tether; unset OTEL_EXPORTER_OTLP_COMPRESSION or set it to none"
            ),
        ));
    }
    let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT").map(|e| join(&e)))
        .unwrap_or_else(|| join("http://localhost:4318"));
    let headers = match env("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        .map(|v| ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", v))
        .or_else(|| env("OTEL_EXPORTER_OTLP_HEADERS").map(|v| ("OTEL_EXPORTER_OTLP_HEADERS", v)))
    {
        Some((var, list)) => parse_headers(var, &list)?,
        None => Vec::new(),
    };
    Ok((endpoint, headers))
}

/// An OTLP header list (`key1=value1,key2=value2`, values percent-encoded), as variable `var`
/// holds it. Empty entries are skipped; an error names a bad entry by its position, never its
/// text.
fn parse_headers(var: &str, list: &str) -> tether::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (n, entry) in list.split(',').map(str::trim).enumerate() {
        if entry.is_empty() {
            continue;
        }
        // Named by position only: an entry may hold a secret.
        let bad = || {
            Error::config(
                tether::ConfigKind::Invalid,
                format!(
                    "{var}: entry {} is not key=value (entries are separated by commas)",
                    n + 1
                ),
            )
        };
        let (k, v) = entry.split_once('=').ok_or_else(bad)?;
        let k = k.trim();
        if k.is_empty() {
            return Err(bad());
        }
        let v = percent_encoding::percent_decode_str(v.trim())
            .decode_utf8()
            .map_err(|_| {
                Error::config(
                    tether::ConfigKind::Invalid,
                    format!("{var}: the value of {k:?} is not percent-encoded UTF-8"),
                )
            })?;
        out.push((k.to_owned(), v.into_owned()));
    }
    Ok(out)
}

/// The TLS files the environment names for `signal` (`TRACES` or `METRICS`): its own
/// `OTEL_EXPORTER_OTLP_{signal}_CERTIFICATE` (and `_CLIENT_CERTIFICATE`, `_CLIENT_KEY`), else the
/// general one, each read and checked now.
fn tls_from_env(signal: &str) -> tether::Result<export::Tls> {
    let read = |name: &str| -> tether::Result<Option<export::Pem>> {
        let own = format!("OTEL_EXPORTER_OTLP_{signal}_{name}");
        let general = format!("OTEL_EXPORTER_OTLP_{name}");
        match env(&own)
            .map(|p| (own, p))
            .or_else(|| env(&general).map(|p| (general, p)))
        {
            Some((var, path)) => export::Pem::read(&var, &path).map(Some),
            None => Ok(None),
        }
    };
    let ca = read("CERTIFICATE")?;
    let identity = match (read("CLIENT_CERTIFICATE")?, read("CLIENT_KEY")?) {
        (Some(cert), Some(key)) => Some(export::ClientIdentity { cert, key }),
        (None, None) => None,
        (Some(one), None) | (None, Some(one)) => {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                format!(
                    "{}: mutual TLS needs both OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY (or their {signal} forms); only this one is set",
                    one.from
                ),
            ));
        }
    };
    let tls = export::Tls { ca, identity };
    tls.check()?;
    Ok(tls)
}

#[cfg(test)]
mod tests {
    use super::parse_headers;

    #[test]
    fn header_lists_parse_as_the_otlp_exporter_specification_says() {
        let h = parse_headers("V", " a = 1 ,, b=x%3Dy=z ,c=%E2%9C%93,").expect("valid");
        assert_eq!(
            h,
            [("a", "1"), ("b", "x=y=z"), ("c", "✓")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .to_vec()
        );
        assert_eq!(parse_headers("V", "").expect("empty"), Vec::new());
        for bad in ["novalue", "=v", "a=1,secret-token", "k=%FF"] {
            let e = parse_headers("V", bad).expect_err(bad).to_string();
            assert!(e.contains("V:"), "{e}");
            assert!(!e.contains("secret"), "{e}");
        }
    }
}
