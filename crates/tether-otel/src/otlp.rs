//! OTLP/HTTP span export with the request body encoded straight from the SDK's spans.
//!
//! Why not `opentelemetry-otlp`'s HTTP span exporter: it converts every span into
//! `opentelemetry-proto`'s owned messages (a `String` per attribute key and value), groups them
//! through a `HashMap`, then lets prost encode them, which walks every nested message's length
//! once per enclosing level. Under `tether serve`'s bench (1,000 concurrent runs) that was
//! ~30 k instructions per run on the export thread, a fifth of what tracing adds to a run
//! (BENCHMARKS.md, "tracing's cost"). Here the body is written in one pass into one buffer: a
//! nested message's length prefix is reserved, the message written after it, and the prefix
//! filled in (moving the message only when its guessed width was wrong). The bytes are exactly
//! prost's (fields in tag order, defaults left out): `tests` compares them with
//! `opentelemetry-proto`'s encoding of the same spans.
//!
//! gRPC export keeps the SDK's tonic exporter.

use std::borrow::Cow;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use opentelemetry::trace::{SpanId, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_http::HttpClient;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};

use crate::export::ExportClient;

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least one.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn key(out: &mut Vec<u8>, tag: u32, wire: u8) {
    varint(out, (u64::from(tag) << 3) | u64::from(wire));
}

fn bytes_field(out: &mut Vec<u8>, tag: u32, b: &[u8]) {
    if !b.is_empty() {
        key(out, tag, LEN);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
}

fn uint_field(out: &mut Vec<u8>, tag: u32, v: u64) {
    if v != 0 {
        key(out, tag, VARINT);
        varint(out, v);
    }
}

fn fixed64_field(out: &mut Vec<u8>, tag: u32, v: u64) {
    if v != 0 {
        key(out, tag, FIXED64);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn fixed32_field(out: &mut Vec<u8>, tag: u32, v: u32) {
    if v != 0 {
        key(out, tag, FIXED32);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Field `tag` holding the message `body` writes. `guess` is the width reserved for its length
/// (1 byte up to 127, 2 up to 16,383); a wrong guess costs one move of the message.
fn message(out: &mut Vec<u8>, tag: u32, guess: usize, body: impl FnOnce(&mut Vec<u8>)) {
    key(out, tag, LEN);
    let at = out.len();
    out.resize(at + guess, 0);
    body(out);
    let len = out.len() - at - guess;
    let need = varint_len(len as u64);
    if need != guess {
        if need > guess {
            out.resize(out.len() + need - guess, 0);
        }
        out.copy_within(at + guess..at + guess + len, at + need);
        out.truncate(at + need + len);
    }
    let mut v = len as u64;
    for b in &mut out[at..at + need] {
        *b = (v as u8 & 0x7f) | 0x80;
        v >>= 7;
    }
    out[at + need - 1] &= 0x7f;
}

/// `AnyValue`'s fields (the oneof) for `v`.
fn any_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::String(s) => string_value(out, s.as_str()),
        Value::Bool(b) => {
            key(out, 2, VARINT);
            varint(out, u64::from(*b));
        }
        Value::I64(i) => {
            key(out, 3, VARINT);
            varint(out, *i as u64);
        }
        Value::F64(f) => {
            key(out, 4, FIXED64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(a) => message(out, 5, 1, |out| match a {
            Array::Bool(v) => v.iter().for_each(|x| element(out, &Value::Bool(*x))),
            Array::I64(v) => v.iter().for_each(|x| element(out, &Value::I64(*x))),
            Array::F64(v) => v.iter().for_each(|x| element(out, &Value::F64(*x))),
            Array::String(v) => v
                .iter()
                .for_each(|x| message(out, 1, 1, |out| string_value(out, x.as_str()))),
            // A kind of array this encoder does not know (the enum is non-exhaustive): empty.
            _ => {}
        }),
        // A kind of value this encoder does not know: an empty `AnyValue`.
        _ => {}
    }
}

/// `AnyValue`'s `string_value`: written even when empty (a oneof member is always present).
fn string_value(out: &mut Vec<u8>, s: &str) {
    key(out, 1, LEN);
    varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// One `ArrayValue.values` element.
fn element(out: &mut Vec<u8>, v: &Value) {
    message(out, 1, 1, |out| any_value(out, v));
}

fn attributes<'a>(out: &mut Vec<u8>, tag: u32, kvs: impl IntoIterator<Item = &'a KeyValue>) {
    for kv in kvs {
        message(out, tag, 1, |out| {
            bytes_field(out, 1, kv.key.as_str().as_bytes());
            message(out, 2, 1, |out| any_value(out, &kv.value));
        });
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// OTLP's span flags: the W3C trace flags, and whether the parent is remote (known, and its
/// value).
fn flags(trace_flags: u8, remote: bool) -> u32 {
    u32::from(trace_flags) | 0x100 | if remote { 0x200 } else { 0 }
}

/// A `Resource` message's fields, encoded once per exporter (the resource does not change).
pub(crate) fn resource(r: &Resource) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in r.iter() {
        message(&mut out, 1, 1, |out| {
            bytes_field(out, 1, k.as_str().as_bytes());
            message(out, 2, 1, |out| any_value(out, v));
        });
    }
    out
}

fn scope(out: &mut Vec<u8>, s: &InstrumentationScope) {
    bytes_field(out, 1, s.name().as_bytes());
    bytes_field(out, 2, s.version().unwrap_or_default().as_bytes());
    attributes(out, 3, s.attributes());
}

fn span(out: &mut Vec<u8>, s: &SpanData) {
    let cx = &s.span_context;
    bytes_field(out, 1, &cx.trace_id().to_bytes());
    bytes_field(out, 2, &cx.span_id().to_bytes());
    bytes_field(out, 3, cx.trace_state().header().as_bytes());
    if s.parent_span_id != SpanId::INVALID {
        bytes_field(out, 4, &s.parent_span_id.to_bytes());
    }
    bytes_field(out, 5, s.name.as_bytes());
    let kind = match s.span_kind {
        opentelemetry::trace::SpanKind::Internal => 1,
        opentelemetry::trace::SpanKind::Server => 2,
        opentelemetry::trace::SpanKind::Client => 3,
        opentelemetry::trace::SpanKind::Producer => 4,
        opentelemetry::trace::SpanKind::Consumer => 5,
    };
    uint_field(out, 6, kind);
    fixed64_field(out, 7, nanos(s.start_time));
    fixed64_field(out, 8, nanos(s.end_time));
    attributes(out, 9, &s.attributes);
    uint_field(out, 10, u64::from(s.dropped_attributes_count));
    for e in &s.events.events {
        message(out, 11, 2, |out| {
            fixed64_field(out, 1, nanos(e.timestamp));
            bytes_field(out, 2, e.name.as_bytes());
            attributes(out, 3, &e.attributes);
            uint_field(out, 4, u64::from(e.dropped_attributes_count));
        });
    }
    uint_field(out, 12, u64::from(s.events.dropped_count));
    for l in &s.links.links {
        message(out, 13, 1, |out| {
            let lc = &l.span_context;
            bytes_field(out, 1, &lc.trace_id().to_bytes());
            bytes_field(out, 2, &lc.span_id().to_bytes());
            bytes_field(out, 3, lc.trace_state().header().as_bytes());
            attributes(out, 4, &l.attributes);
            uint_field(out, 5, u64::from(l.dropped_attributes_count));
            fixed32_field(out, 6, flags(lc.trace_flags().to_u8(), lc.is_remote()));
        });
    }
    uint_field(out, 14, u64::from(s.links.dropped_count));
    message(out, 15, 1, |out| {
        let (code, msg): (u64, Cow<'_, str>) = match &s.status {
            Status::Unset => (0, Cow::Borrowed("")),
            Status::Ok => (1, Cow::Borrowed("")),
            Status::Error { description } => (2, Cow::Borrowed(description.as_ref())),
        };
        bytes_field(out, 2, msg.as_bytes());
        uint_field(out, 3, code);
    });
    fixed32_field(out, 16, flags(cx.trace_flags().to_u8(), s.parent_span_is_remote));
}

/// An `ExportTraceServiceRequest` for `spans`: one `ResourceSpans` of the resource whose fields
/// `resource` holds (and its schema URL), a `ScopeSpans` per instrumentation scope in the order
/// the scopes first appear, each scope's spans in batch order. The same bytes as
/// `opentelemetry-otlp` sends for the batch.
pub(crate) fn encode(resource: &[u8], schema_url: &str, spans: &[SpanData]) -> Vec<u8> {
    // Scopes in order of first appearance, with their spans' positions. A batch holds a scope
    // or two: a list beats a map.
    let mut scopes: Vec<(&InstrumentationScope, Vec<usize>)> = Vec::new();
    for (i, s) in spans.iter().enumerate() {
        match scopes.iter_mut().find(|(sc, _)| *sc == &s.instrumentation_scope) {
            Some((_, v)) => v.push(i),
            None => scopes.push((&s.instrumentation_scope, vec![i])),
        }
    }
    let mut out = Vec::with_capacity(64 + resource.len() + spans.len() * 768);
    message(&mut out, 1, 3, |out| {
        message(out, 1, 1, |out| out.extend_from_slice(resource));
        for (sc, idx) in &scopes {
            message(out, 2, 3, |out| {
                message(out, 1, 1, |out| scope(out, sc));
                for &i in idx {
                    message(out, 2, 2, |out| span(out, &spans[i]));
                }
                bytes_field(out, 3, sc.schema_url().unwrap_or_default().as_bytes());
            });
        }
        bytes_field(out, 3, schema_url.as_bytes());
    });
    out
}

/// Retries after a failed attempt (the OTLP exporters' recommended policy): three, waiting
/// 100 ms, doubling, at most 1.6 s, all within the export timeout.
const RETRIES: u32 = 3;
const FIRST_WAIT: Duration = Duration::from_millis(100);
const MAX_WAIT: Duration = Duration::from_millis(1600);
/// The longest `retry-after` honoured.
const MAX_THROTTLE: Duration = Duration::from_secs(30);

/// The span exporter for OTLP/HTTP with protobuf bodies: [`encode`], then a POST to the
/// collector with tether's HTTP client, retried on a network error, 429, 502, 503 and 504.
#[derive(Debug)]
pub(crate) struct HttpSpans {
    client: ExportClient,
    endpoint: http::Uri,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    timeout: Duration,
    resource: Vec<u8>,
    schema_url: String,
}

impl HttpSpans {
    /// Posting to `endpoint` (the full URL, `/v1/traces` included) with `headers`.
    pub(crate) fn new(
        client: ExportClient,
        endpoint: &str,
        headers: &[(String, String)],
        timeout: Duration,
    ) -> tether::Result<HttpSpans> {
        let invalid = |msg: String| tether::Error::config(tether::ConfigKind::Invalid, msg);
        let endpoint: http::Uri = endpoint
            .parse()
            .map_err(|e| invalid(format!("the OTLP traces endpoint {endpoint:?} is not a URL: {e}")))?;
        if !matches!(endpoint.scheme_str(), Some("http" | "https")) {
            return Err(invalid(format!(
                "the OTLP traces endpoint {endpoint} is not an http:// or https:// URL"
            )));
        }
        let mut hs = Vec::with_capacity(headers.len());
        for (k, v) in headers {
            let name = http::HeaderName::from_bytes(k.trim().as_bytes()).map_err(|_| {
                invalid(format!(
                    "the OTLP header name {k:?} is not a valid HTTP header name"
                ))
            })?;
            let value = http::HeaderValue::from_str(v).map_err(|_| {
                invalid(format!(
                    "the OTLP header {k:?} has a value that cannot be sent in HTTP"
                ))
            })?;
            hs.push((name, value));
        }
        Ok(HttpSpans {
            client,
            endpoint,
            headers: hs,
            timeout,
            resource: resource(&Resource::builder_empty().build()),
            schema_url: String::new(),
        })
    }

    fn request(&self, body: &Bytes) -> Result<http::Request<Bytes>, OTelSdkError> {
        let mut r = http::Request::post(self.endpoint.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(body.clone())
            .map_err(|e| OTelSdkError::InternalFailure(format!("cannot build the OTLP request: {e}")))?;
        for (k, v) in &self.headers {
            r.headers_mut().insert(k.clone(), v.clone());
        }
        Ok(r)
    }
}

impl SpanExporter for HttpSpans {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let body = Bytes::from(encode(&self.resource, &self.schema_url, &batch));
        drop(batch);
        let start = Instant::now();
        let mut wait = FIRST_WAIT;
        for attempt in 0..=RETRIES {
            let (failure, retry_after) = match self.client.send_bytes(self.request(&body)?).await {
                Ok(resp) if resp.status().is_success() => return Ok(()),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let failure = format!("the collector answered HTTP {status}");
                    if !matches!(status, 429 | 502 | 503 | 504) {
                        return Err(OTelSdkError::InternalFailure(failure));
                    }
                    let after = resp
                        .headers()
                        .get(http::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| tether::retry::parse_retry_after(None, Some(v)))
                        // A date already past: no hint, the backoff applies.
                        .filter(|d| !d.is_zero());
                    (failure, after)
                }
                Err(e) => (format!("the export request failed: {e}"), None),
            };
            let pause = retry_after.map_or(wait, |d| d.min(MAX_THROTTLE));
            if attempt == RETRIES || start.elapsed() + pause >= self.timeout {
                return Err(OTelSdkError::InternalFailure(failure));
            }
            tokio::time::sleep(pause).await;
            wait = (wait * 2).min(MAX_WAIT);
        }
        Err(OTelSdkError::InternalFailure("the export failed".into()))
    }

    fn set_resource(&mut self, r: &Resource) {
        self.resource = resource(r);
        self.schema_url = r.schema_url().unwrap_or_default().to_owned();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanKind, TraceFlags, TraceId, TraceState};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use proptest::prelude::*;
    use prost::Message;

    fn prost_bytes(r: &Resource, spans: Vec<SpanData>) -> Vec<u8> {
        let res = ResourceAttributesWithSchema::from(r);
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans, &res),
        }
        .encode_to_vec()
    }

    fn value() -> impl Strategy<Value = Value> {
        prop_oneof![
            ".{0,40}".prop_map(Value::from),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::I64),
            any::<f64>().prop_map(Value::F64),
            proptest::collection::vec(any::<i64>(), 0..4).prop_map(|v| Value::Array(Array::I64(v))),
            proptest::collection::vec(any::<bool>(), 0..4).prop_map(|v| Value::Array(Array::Bool(v))),
            proptest::collection::vec(any::<f64>(), 0..4).prop_map(|v| Value::Array(Array::F64(v))),
            proptest::collection::vec(".{0,8}", 0..4)
                .prop_map(|v| Value::Array(Array::String(v.into_iter().map(Into::into).collect()))),
        ]
    }

    fn kvs(max: usize) -> impl Strategy<Value = Vec<KeyValue>> {
        proptest::collection::vec(("[a-z._]{0,20}", value()), 0..max)
            .prop_map(|v| v.into_iter().map(|(k, v)| KeyValue::new(k, v)).collect())
    }

    fn cx(t: u128, s: u64, flags: u8, remote: bool, state: bool) -> SpanContext {
        let ts = if state {
            TraceState::from_key_value([("vendor", "x1")]).unwrap_or_default()
        } else {
            TraceState::default()
        };
        SpanContext::new(
            TraceId::from(t),
            SpanId::from(s),
            TraceFlags::new(flags),
            remote,
            ts,
        )
    }

    prop_compose! {
        fn span_data()(
            t in any::<u128>(), s in any::<u64>(), parent in prop_oneof![Just(0u64), any::<u64>()],
            flags in any::<u8>(), remote in any::<bool>(), state in any::<bool>(),
            name in ".{0,30}", kind in 0..5u8, start in any::<u64>(), len in 0..u32::MAX as u64,
            attrs in kvs(12), dropped in prop_oneof![Just(0u32), any::<u32>()],
            events in proptest::collection::vec((".{0,10}", any::<u32>(), kvs(3), 0..3u32), 0..3),
            dropped_events in 0..3u32,
            links in proptest::collection::vec((any::<u128>(), any::<u64>(), any::<bool>(), kvs(3), 0..2u32), 0..3),
            status in 0..3u8, desc in ".{0,20}", scope_pick in 0..3u8,
        ) -> SpanData {
            let at = |n: u64| UNIX_EPOCH + Duration::from_nanos(n);
            let kind = [SpanKind::Internal, SpanKind::Server, SpanKind::Client, SpanKind::Producer, SpanKind::Consumer][kind as usize].clone();
            let mut ev = SpanEvents::default();
            for (n, off, a, d) in events {
                ev.events.push(opentelemetry::trace::Event::new(n, at(start.saturating_add(u64::from(off))), a, d));
            }
            ev.dropped_count = dropped_events;
            let mut ls = SpanLinks::default();
            for (lt, lsid, lr, a, d) in links {
                let mut l = opentelemetry::trace::Link::new(cx(lt, lsid, 1, lr, lr), a, d);
                l.dropped_attributes_count = d;
                ls.links.push(l);
            }
            let scope = match scope_pick {
                0 => InstrumentationScope::builder("tether").build(),
                1 => InstrumentationScope::builder("other").with_version("1.2").with_schema_url("https://s/1").with_attributes([KeyValue::new("k", 1)]).build(),
                _ => InstrumentationScope::builder("").build(),
            };
            SpanData {
                span_context: cx(t, s, flags, false, state),
                parent_span_id: SpanId::from(parent),
                parent_span_is_remote: remote,
                span_kind: kind,
                name: name.into(),
                start_time: at(start),
                end_time: at(start.saturating_add(len)),
                attributes: attrs,
                dropped_attributes_count: dropped,
                events: ev,
                links: ls,
                status: match status { 0 => Status::Unset, 1 => Status::Ok, _ => Status::error(desc) },
                instrumentation_scope: scope,
            }
        }
    }

    proptest! {
        /// The body is byte for byte what opentelemetry-proto and prost make of the same batch.
        #[test]
        fn encodes_as_prost_does(spans in proptest::collection::vec(span_data(), 0..6), res in kvs(5), schema in prop_oneof![Just(None), Just(Some("https://schema/1"))]) {
            let mut b = Resource::builder_empty().with_attributes(res);
            if let Some(s) = schema {
                b = b.with_schema_url(Vec::<KeyValue>::new(), s);
            }
            let r = b.build();
            let ours = encode(&resource(&r), r.schema_url().unwrap_or_default(), &spans);
            prop_assert_eq!(ours, prost_bytes(&r, spans));
        }
    }

    #[test]
    fn a_message_over_127_bytes_gets_a_wider_length() {
        for n in [0usize, 1, 126, 127, 128, 129, 16_383, 16_384, 20_000] {
            let mut out = Vec::new();
            message(&mut out, 1, 1, |out| out.extend(std::iter::repeat_n(7u8, n)));
            let mut want = vec![0x0a];
            varint(&mut want, n as u64);
            want.extend(std::iter::repeat_n(7u8, n));
            assert_eq!(out, want, "{n} bytes");
            let mut wide = Vec::new();
            message(&mut wide, 1, 3, |out| out.extend(std::iter::repeat_n(7u8, n)));
            assert_eq!(wide, want, "{n} bytes, 3 reserved");
        }
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(u64::MAX), 10);
    }
}
