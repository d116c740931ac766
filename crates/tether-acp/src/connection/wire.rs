//! The JSON-RPC 2.0 message shapes: the inbound envelope (borrowed, presence-aware) and the
//! outbound frames, and the lenient `session/update` decoder.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::handler::{AcpUpdate, SessionUpdateEvent};
use crate::schema::{Meta, RequestId, SessionId, SessionUpdate};

/// Presence-aware JSON field: `null` is `Present`, a missing key is `Absent`.
#[derive(Default, Clone, Copy)]
pub(super) enum Field<'a> {
    #[default]
    Absent,
    Present(&'a RawValue),
}

impl<'de: 'a, 'a> Deserialize<'de> for Field<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a RawValue>::deserialize(d).map(Field::Present)
    }
}

impl<'a> Field<'a> {
    pub(super) fn raw(self) -> Option<&'a RawValue> {
        match self {
            Field::Absent => None,
            Field::Present(r) => Some(r),
        }
    }
}

#[derive(Deserialize)]
pub(super) struct Envelope<'a> {
    #[serde(default, borrow)]
    pub(super) id: Field<'a>,
    #[serde(default, borrow)]
    pub(super) method: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    pub(super) params: Field<'a>,
    #[serde(default, borrow)]
    pub(super) result: Field<'a>,
    #[serde(default, borrow)]
    pub(super) error: Field<'a>,
}

#[derive(Deserialize)]
pub(super) struct WireError {
    #[serde(default)]
    pub(super) code: i64,
    #[serde(default)]
    pub(super) message: String,
    #[serde(default)]
    pub(super) data: Option<Value>,
}

#[derive(Deserialize, Default)]
pub(super) struct SessionHint {
    #[serde(default)]
    pub(super) params: Option<SessionHintParams>,
}

#[derive(Deserialize, Default)]
pub(super) struct SessionHintParams {
    #[serde(default, rename = "sessionId")]
    pub(super) session_id: Option<SessionId>,
}

#[derive(Deserialize)]
pub(super) struct UpdateParams<'a> {
    #[serde(rename = "sessionId")]
    pub(super) session_id: SessionId,
    #[serde(borrow)]
    pub(super) update: &'a RawValue,
    #[serde(default, rename = "_meta")]
    pub(super) meta: Option<Meta>,
}

#[derive(Serialize)]
pub(super) struct OutRequest<'a, P: Serialize> {
    pub(super) jsonrpc: &'static str,
    pub(super) id: i64,
    pub(super) method: &'a str,
    pub(super) params: &'a P,
}

#[derive(Serialize)]
pub(super) struct OutNotification<'a, P: Serialize> {
    pub(super) jsonrpc: &'static str,
    pub(super) method: &'a str,
    pub(super) params: &'a P,
}

#[derive(Serialize)]
pub(super) struct OutResult<'a> {
    pub(super) jsonrpc: &'static str,
    pub(super) id: &'a RequestId,
    pub(super) result: &'a Value,
}

#[derive(Serialize)]
pub(super) struct OutErrorBody<'a> {
    pub(super) code: i32,
    pub(super) message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) data: &'a Option<Value>,
}

#[derive(Serialize)]
pub(super) struct OutError<'a> {
    pub(super) jsonrpc: &'static str,
    pub(super) id: &'a RequestId,
    pub(super) error: OutErrorBody<'a>,
}

/// Decodes a `session/update`'s params leniently: unknown kinds (and known kinds that fail to
/// decode) become [`AcpUpdate::Unknown`] with the raw JSON.
pub(crate) fn parse_update(params: &str) -> Result<SessionUpdateEvent, String> {
    let p: UpdateParams<'_> =
        serde_json::from_str(params).map_err(|e| format!("invalid session/update params: {e}"))?;
    let update = match serde_json::from_str::<SessionUpdate>(p.update.get()) {
        Ok(u) => AcpUpdate::Known(Box::new(u)),
        Err(e) => {
            let raw: Value = serde_json::from_str(p.update.get()).unwrap_or(Value::Null);
            let kind = raw
                .get("sessionUpdate")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            AcpUpdate::Unknown {
                kind,
                raw,
                error: Some(e.to_string()),
            }
        }
    };
    Ok(SessionUpdateEvent {
        session_id: p.session_id,
        update,
        meta: p.meta,
    })
}

pub(super) fn null_raw() -> &'static RawValue {
    // `RawValue::NULL` is a valid `&'static RawValue` for JSON `null`.
    RawValue::NULL
}
