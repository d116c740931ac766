//! `TetherThreadNotes`: a front-end's bookkeeping about a thread (keyed by thread id), beside the
//! thread's record.
//!
//! What a front-end must write while a turn waits for an approval (the AG-UI interrupts it
//! issued, the last sequence number it showed) cannot go through the `TetherThread` object: its
//! state is written only by the exclusive `turn`, and an exclusive call queues behind a turn
//! suspended on an awakeable. This object's handlers are short and never suspend, so a write
//! here never waits for a turn.

use restate_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The longest note key, in bytes.
pub const MAX_KEY: usize = 256;

/// The most notes one `put_all` call writes.
pub const MAX_NOTES: usize = 16;

/// The body of a `put` call: a named value (`null` clears it).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Note {
    /// The note's name (1 to 256 bytes, no control characters).
    pub key: String,
    /// Its value.
    pub value: Value,
}

impl Note {
    /// The note `key` = `value`.
    pub fn new(key: impl Into<String>, value: Value) -> Self {
        Note {
            key: key.into(),
            value,
        }
    }
}

fn state_key(key: &str) -> Result<String, TerminalError> {
    if key.is_empty() || key.len() > MAX_KEY || key.chars().any(char::is_control) {
        return Err(TerminalError::new_with_code(
            400,
            "a note key is 1 to 256 bytes without control characters",
        ));
    }
    Ok(format!("note:{key}"))
}

/// Writes note state `key` (a checked key, see [`state_key`]): `null` removes it.
fn write(ctx: &ObjectContext<'_>, key: &str, value: Value) {
    if value.is_null() {
        ctx.clear(key);
    } else {
        ctx.set(key, Json(value));
    }
}

/// The notes object (see the module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct TetherThreadNotes;

#[restate_sdk::object]
impl TetherThreadNotes {
    /// Stores a note (overwriting; a `null` value removes it).
    #[handler]
    async fn put(&self, ctx: ObjectContext<'_>, note: Json<Note>) -> Result<(), HandlerError> {
        let note = note.into_inner();
        let key = state_key(&note.key)?;
        write(&ctx, &key, note.value);
        Ok(())
    }

    /// Stores several notes at once, in order (as many [`put`](Self::put) calls, in one
    /// invocation: a front-end that writes two notes before a turn queues once). At most
    /// [`MAX_NOTES`] notes; none is written when one is refused.
    #[handler]
    async fn put_all(&self, ctx: ObjectContext<'_>, notes: Json<Vec<Note>>) -> Result<(), HandlerError> {
        let notes = notes.into_inner();
        if notes.len() > MAX_NOTES {
            return Err(
                TerminalError::new_with_code(400, format!("at most {MAX_NOTES} notes at once")).into(),
            );
        }
        let keys = notes
            .iter()
            .map(|n| state_key(&n.key))
            .collect::<Result<Vec<_>, _>>()?;
        for (key, note) in keys.iter().zip(notes) {
            write(&ctx, key, note.value);
        }
        Ok(())
    }

    /// Reads a note (`null` when there is none).
    #[handler]
    async fn get(
        &self,
        ctx: SharedObjectContext<'_>,
        key: Json<String>,
    ) -> Result<Json<Value>, HandlerError> {
        let key = state_key(&key.into_inner())?;
        Ok(Json(
            ctx.get::<Json<Value>>(&key)
                .await?
                .map(Json::into_inner)
                .unwrap_or(Value::Null),
        ))
    }
}
