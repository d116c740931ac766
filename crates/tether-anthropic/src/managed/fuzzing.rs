//! How [`ManagedAgents`](super::ManagedAgents) reads its event stream, without the HTTP, for the
//! crate's `fuzzing` module (not part of the API): the frame filter of `turn` and the event
//! mapping it applies to each event. Keep in step with `turn`.

use serde_json::Value;
use tether::{Error, Event};

use super::{Boundary, boundary_of, to_event};
use crate::http::stream_error;
use crate::sse::SseFrame;

/// What `turn` makes of one frame: nothing (skipped), an error ending the turn, or the event it
/// records and the boundary it reads off it (`none`, `end:<terminal>`, `requires_action:<ids>`).
pub(crate) fn frame(frame: &SseFrame) -> Option<Result<(Event, String), Error>> {
    if frame.data.trim().is_empty() || frame.event.as_deref() == Some("ping") {
        return None;
    }
    let data: Value = serde_json::from_str(&frame.data).ok()?;
    if frame.event.as_deref() == Some("error") || data["type"] == "error" {
        return Some(Err(stream_error(&data)));
    }
    if data["type"] == "ping" {
        return None;
    }
    let boundary = match boundary_of(&data) {
        Boundary::None => "none".to_owned(),
        Boundary::End(t, _) => format!("end:{t:?}"),
        Boundary::RequiresAction(ids) => format!("requires_action:{ids:?}"),
    };
    Some(Ok((to_event(&data), boundary)))
}
