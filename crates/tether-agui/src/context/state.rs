//! The typed state, what the client last saw of it, and the event that brings the client up
//! to date (snapshot or JSON-Patch delta).

use super::*;

/// Typed state plus what the client last saw of it (as the compact JSON last published).
pub(crate) struct StateManager<S> {
    pub(super) value: S,
    pub(super) published: Option<Vec<u8>>,
}

struct CountingWriter {
    pub(super) n: usize,
    pub(super) limit: usize,
}

impl std::io::Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.n += buf.len();
        if self.n > self.limit {
            return Err(std::io::Error::other("limit"));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `value` serializes to more than `limit` bytes (stops counting past the limit).
pub(super) fn serialized_len_exceeds(value: &Value, limit: usize) -> bool {
    let mut w = CountingWriter { n: 0, limit };
    serde_json::to_writer(&mut w, value).is_err()
}

/// The event that brings a client holding `old` (or nothing) to `new`: a snapshot first, a
/// JSON-Patch delta when it is smaller than the snapshot, nothing when unchanged.
pub fn state_update(old: Option<&Value>, new: &Value) -> AgUiResult<Option<AgUiEvent>> {
    let Some(old) = old else {
        return Ok(Some(AgUiEvent::state_snapshot(new.clone())));
    };
    let ops = patch::diff(old, new);
    if ops.is_empty() {
        return Ok(None);
    }
    let patch_len = serde_json::to_vec(&ops)?.len();
    if serialized_len_exceeds(new, patch_len) {
        Ok(Some(AgUiEvent::state_delta(ops)))
    } else {
        Ok(Some(AgUiEvent::state_snapshot(new.clone())))
    }
}

/// [`state_update`] over serialized states (`serde_json::to_vec` output), as the run's
/// typed state is published.
///
/// Two serializations of one state usually differ in a short stretch: the smallest value
/// covering it becomes a single `replace` without building either tree. Otherwise both
/// documents are parsed and diffed as trees.
pub fn state_update_json(old: Option<&[u8]>, new: &[u8]) -> AgUiResult<Option<AgUiEvent>> {
    let Some(old) = old else {
        return Ok(Some(AgUiEvent::state_snapshot(serde_json::from_slice(new)?)));
    };
    if old == new {
        return Ok(None);
    }
    // A replacement up to 1/8 of the document is taken as it is; beyond that a tree diff may
    // find a much smaller patch (an append to a long list, say).
    if let Some(ops) = crate::bytediff::replace_patch(old, new, (new.len() / 8).max(256)) {
        let patch_len = serde_json::to_vec(&ops)?.len();
        if patch_len < new.len() {
            return Ok(Some(AgUiEvent::state_delta(ops)));
        }
    }
    let old: Value = serde_json::from_slice(old)?;
    let new: Value = serde_json::from_slice(new)?;
    state_update(Some(&old), &new)
}

impl<S: AgentState> StateManager<S> {
    pub(super) fn publish(&mut self, sink: &mut Sink) -> AgUiResult<()> {
        let new = serde_json::to_vec(&self.value)?;
        if let Some(event) = state_update_json(self.published.as_deref(), &new)? {
            sink.emit(event)?;
        }
        self.published = Some(new);
        Ok(())
    }
}

macro_rules! state_trio {
    () => {
        /// The typed state, as left by the last change.
        pub fn state(&self) -> &S {
            &self.state.value
        }

        /// The typed state, mutably. Nothing is emitted until [`Self::publish_state`].
        pub fn state_mut(&mut self) -> &mut S {
            &mut self.state.value
        }

        /// Publishes the state: `STATE_SNAPSHOT` the first time, then a JSON-Patch
        /// `STATE_DELTA` when that is smaller than a snapshot, nothing when unchanged.
        pub fn publish_state(&mut self) -> AgUiResult<()> {
            self.state.publish(self.sink)
        }
    };
}
