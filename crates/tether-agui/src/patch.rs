//! RFC 6902 JSON Patch: the operation type, a diff that produces the patch turning one JSON
//! value into another, and an `apply` used to check it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One RFC 6902 operation. `path`/`from` are RFC 6901 JSON Pointers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
#[non_exhaustive]
pub enum PatchOperation {
    /// Adds a member or inserts an array element.
    Add {
        /// Target.
        path: String,
        /// Value (may be `null`).
        value: Value,
    },
    /// Removes the target.
    Remove {
        /// Target.
        path: String,
    },
    /// Replaces the target.
    Replace {
        /// Target.
        path: String,
        /// Value (may be `null`).
        value: Value,
    },
    /// Moves `from` to `path`.
    Move {
        /// Source.
        from: String,
        /// Target.
        path: String,
    },
    /// Copies `from` to `path`.
    Copy {
        /// Source.
        from: String,
        /// Target.
        path: String,
    },
    /// Fails the patch unless the target equals `value`.
    Test {
        /// Target.
        path: String,
        /// Expected value.
        value: Value,
    },
}

impl PatchOperation {
    /// The operation name (`"add"`, ...).
    pub fn op(&self) -> &'static str {
        match self {
            PatchOperation::Add { .. } => "add",
            PatchOperation::Remove { .. } => "remove",
            PatchOperation::Replace { .. } => "replace",
            PatchOperation::Move { .. } => "move",
            PatchOperation::Copy { .. } => "copy",
            PatchOperation::Test { .. } => "test",
        }
    }

    /// The `path`.
    pub fn path(&self) -> &str {
        match self {
            PatchOperation::Add { path, .. }
            | PatchOperation::Remove { path }
            | PatchOperation::Replace { path, .. }
            | PatchOperation::Move { path, .. }
            | PatchOperation::Copy { path, .. }
            | PatchOperation::Test { path, .. } => path,
        }
    }

    /// The `from`, for move and copy.
    pub fn from(&self) -> Option<&str> {
        match self {
            PatchOperation::Move { from, .. } | PatchOperation::Copy { from, .. } => Some(from),
            _ => None,
        }
    }

    /// The `value`, for add, replace and test.
    pub fn value(&self) -> Option<&Value> {
        match self {
            PatchOperation::Add { value, .. }
            | PatchOperation::Replace { value, .. }
            | PatchOperation::Test { value, .. } => Some(value),
            _ => None,
        }
    }
}

/// Whether `pointer` is a syntactically valid RFC 6901 JSON Pointer
/// (`^(/([^/~]|~[01])*)*$`), by the `jsonptr` crate `json-patch` uses.
pub fn is_valid_pointer(pointer: &str) -> bool {
    json_patch::jsonptr::Pointer::parse(pointer).is_ok()
}

/// The patch that turns `from` into `to` (empty when they are equal), by the `json-patch`
/// crate: objects are diffed member by member, arrays element by element, anything else is
/// replaced. Applying the result to `from` yields exactly `to`.
///
/// This is the fallback of [`crate::context::state_update_json`], whose fast path (a byte
/// diff of the two serializations) needs no tree at all.
pub fn diff(from: &Value, to: &Value) -> Vec<PatchOperation> {
    json_patch::diff(from, to).0.into_iter().map(Into::into).collect()
}

impl From<json_patch::PatchOperation> for PatchOperation {
    fn from(op: json_patch::PatchOperation) -> Self {
        use json_patch::PatchOperation as J;
        match op {
            J::Add(o) => PatchOperation::Add {
                path: o.path.to_string(),
                value: o.value,
            },
            J::Remove(o) => PatchOperation::Remove {
                path: o.path.to_string(),
            },
            J::Replace(o) => PatchOperation::Replace {
                path: o.path.to_string(),
                value: o.value,
            },
            J::Move(o) => PatchOperation::Move {
                from: o.from.to_string(),
                path: o.path.to_string(),
            },
            J::Copy(o) => PatchOperation::Copy {
                from: o.from.to_string(),
                path: o.path.to_string(),
            },
            J::Test(o) => PatchOperation::Test {
                path: o.path.to_string(),
                value: o.value,
            },
        }
    }
}

impl PatchOperation {
    /// The operation as the `json-patch` crate's, its pointers parsed (`Err` when one is not a
    /// valid JSON Pointer).
    fn to_json_patch(&self) -> Result<json_patch::PatchOperation, &'static str> {
        use json_patch::jsonptr::PointerBuf;
        use json_patch::{
            AddOperation, CopyOperation, MoveOperation, PatchOperation as J, RemoveOperation,
            ReplaceOperation, TestOperation,
        };
        let ptr = |p: &str| PointerBuf::parse(p).map_err(|_| "malformed JSON Pointer");
        Ok(match self {
            PatchOperation::Add { path, value } => J::Add(AddOperation {
                path: ptr(path)?,
                value: value.clone(),
            }),
            PatchOperation::Remove { path } => J::Remove(RemoveOperation { path: ptr(path)? }),
            PatchOperation::Replace { path, value } => J::Replace(ReplaceOperation {
                path: ptr(path)?,
                value: value.clone(),
            }),
            PatchOperation::Move { from, path } => J::Move(MoveOperation {
                from: ptr(from)?,
                path: ptr(path)?,
            }),
            PatchOperation::Copy { from, path } => J::Copy(CopyOperation {
                from: ptr(from)?,
                path: ptr(path)?,
            }),
            PatchOperation::Test { path, value } => J::Test(TestOperation {
                path: ptr(path)?,
                value: value.clone(),
            }),
        })
    }
}

/// Why a patch did not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("JSON Patch operation {index} ({op} {path}) does not apply: {reason}")]
#[non_exhaustive]
pub struct PatchError {
    /// Index of the failing operation.
    pub index: usize,
    /// Its op name.
    pub op: &'static str,
    /// Its path.
    pub path: String,
    /// Why.
    pub reason: &'static str,
}

/// Applies `patch` to `doc` in place, all or nothing, by the `json-patch` crate.
pub fn apply(doc: &mut Value, patch: &[PatchOperation]) -> Result<(), PatchError> {
    let mut ops = Vec::with_capacity(patch.len());
    for (index, op) in patch.iter().enumerate() {
        let parsed = op.to_json_patch().map_err(|reason| PatchError {
            index,
            op: op.op(),
            path: op.path().to_owned(),
            reason,
        })?;
        ops.push(parsed);
    }
    json_patch::patch(doc, &ops).map_err(|e| {
        use json_patch::PatchErrorKind as K;
        let reason = match e.kind {
            K::TestFailed => "test failed",
            K::InvalidFromPointer => "from not found",
            K::InvalidPointer => "path not found",
            K::CannotMoveInsideItself => "cannot move a value into itself",
            _ => "does not apply",
        };
        let op = patch.get(e.operation);
        PatchError {
            index: e.operation,
            op: op.map_or("?", PatchOperation::op),
            path: op.map_or_else(|| e.path.to_string(), |o| o.path().to_owned()),
            reason,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn diff_of_one_leaf_is_one_replace() {
        let a = json!({"a": {"b": [1, 2, {"c": "x"}]}, "d~/e": 1});
        let mut b = a.clone();
        b["a"]["b"][2]["c"] = json!("y");
        b["d~/e"] = json!(2);
        let ops = diff(&a, &b);
        assert_eq!(
            serde_json::to_value(&ops).unwrap(),
            json!([
                {"op": "replace", "path": "/a/b/2/c", "value": "y"},
                {"op": "replace", "path": "/d~0~1e", "value": 2}
            ])
        );
        let mut c = a.clone();
        apply(&mut c, &ops).unwrap();
        assert_eq!(c, b);
    }

    #[test]
    fn array_shrink_removes_from_the_end() {
        let a = json!([1, 2, 3, 4]);
        let b = json!([1, 5]);
        let ops = diff(&a, &b);
        // One replace, then the extra elements removed one by one (json-patch removes at the
        // shrunk array's new end each time), and applying it gives exactly `b`.
        assert_eq!(
            serde_json::to_value(&ops).unwrap(),
            json!([
                {"op": "replace", "path": "/1", "value": 5},
                {"op": "remove", "path": "/2"},
                {"op": "remove", "path": "/2"}
            ])
        );
        let mut doc = a.clone();
        apply(&mut doc, &ops).unwrap();
        assert_eq!(doc, b);
        // All or nothing: a patch whose second operation fails leaves the document unchanged.
        let mut doc = a.clone();
        let bad = vec![ops[0].clone(), PatchOperation::Remove { path: "/9".into() }];
        let e = apply(&mut doc, &bad).unwrap_err();
        assert_eq!((e.index, e.op), (1, "remove"));
        assert_eq!(doc, a);
    }

    #[test]
    fn pointers_are_validated() {
        assert!(is_valid_pointer(""));
        assert!(is_valid_pointer("/a~0b/~1"));
        assert!(!is_valid_pointer("a"));
        assert!(!is_valid_pointer("/a~2"));
        assert!(!is_valid_pointer("/a~"));
    }
}
