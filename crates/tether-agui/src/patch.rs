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
/// (`^(/([^/~]|~[01])*)*$`).
pub fn is_valid_pointer(pointer: &str) -> bool {
    if pointer.is_empty() {
        return true;
    }
    if !pointer.starts_with('/') {
        return false;
    }
    let bytes = pointer.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'~' {
            match bytes.get(i + 1) {
                Some(b'0') | Some(b'1') => i += 2,
                _ => return false,
            }
        } else {
            i += 1;
        }
    }
    true
}

/// Appends one escaped reference token (`~` → `~0`, `/` → `~1`) to a pointer.
fn push_token(pointer: &mut String, token: &str) {
    pointer.push('/');
    if !token.contains(['~', '/']) {
        pointer.push_str(token);
        return;
    }
    for c in token.chars() {
        match c {
            '~' => pointer.push_str("~0"),
            '/' => pointer.push_str("~1"),
            c => pointer.push(c),
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// The patch that turns `from` into `to` (empty when they are equal).
///
/// Objects are diffed member by member, arrays element by element (extra elements are added
/// or removed at the end), anything else is replaced. Applying the result to `from` yields
/// exactly `to`.
pub fn diff(from: &Value, to: &Value) -> Vec<PatchOperation> {
    let mut ops = Vec::new();
    let mut path = String::new();
    diff_into(from, to, &mut path, &mut ops);
    ops
}

fn diff_into(from: &Value, to: &Value, path: &mut String, ops: &mut Vec<PatchOperation>) {
    match (from, to) {
        (Value::Object(a), Value::Object(b)) => {
            let base = path.len();
            for (k, va) in a {
                match b.get(k) {
                    // Equal leaves are skipped without building their paths; containers are
                    // walked once by the recursion (comparing them first would walk them twice).
                    Some(vb) if is_leaf(va) && va == vb => continue,
                    Some(vb) => {
                        push_token(path, k);
                        diff_into(va, vb, path, ops);
                    }
                    None => {
                        push_token(path, k);
                        ops.push(PatchOperation::Remove { path: path.clone() });
                    }
                }
                path.truncate(base);
            }
            for (k, vb) in b {
                if !a.contains_key(k) {
                    push_token(path, k);
                    ops.push(PatchOperation::Add {
                        path: path.clone(),
                        value: vb.clone(),
                    });
                    path.truncate(base);
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            let base = path.len();
            let common = a.len().min(b.len());
            for i in 0..common {
                if a[i] == b[i] {
                    continue;
                }
                push_index(path, i);
                diff_into(&a[i], &b[i], path, ops);
                path.truncate(base);
            }
            if b.len() > a.len() {
                for (i, v) in b.iter().enumerate().skip(common) {
                    push_index(path, i);
                    ops.push(PatchOperation::Add {
                        path: path.clone(),
                        value: v.clone(),
                    });
                    path.truncate(base);
                }
            } else {
                for i in (common..a.len()).rev() {
                    push_index(path, i);
                    ops.push(PatchOperation::Remove { path: path.clone() });
                    path.truncate(base);
                }
            }
        }
        (a, b) => {
            if a != b {
                ops.push(PatchOperation::Replace {
                    path: path.clone(),
                    value: b.clone(),
                });
            }
        }
    }
}

fn is_leaf(v: &Value) -> bool {
    !matches!(v, Value::Object(_) | Value::Array(_))
}

fn push_index(pointer: &mut String, i: usize) {
    use std::fmt::Write as _;
    let _ = write!(pointer, "/{i}");
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

/// Applies `patch` to `doc` in place (all or nothing).
pub fn apply(doc: &mut Value, patch: &[PatchOperation]) -> Result<(), PatchError> {
    let mut work = doc.clone();
    for (index, op) in patch.iter().enumerate() {
        let fail = |reason| PatchError {
            index,
            op: op.op(),
            path: op.path().to_owned(),
            reason,
        };
        if !is_valid_pointer(op.path()) || op.from().is_some_and(|f| !is_valid_pointer(f)) {
            return Err(fail("malformed JSON Pointer"));
        }
        match op {
            PatchOperation::Add { path, value } => add(&mut work, path, value.clone()).map_err(fail)?,
            PatchOperation::Remove { path } => {
                remove(&mut work, path).map_err(fail)?;
            }
            PatchOperation::Replace { path, value } => {
                let target = work.pointer_mut(path).ok_or_else(|| fail("path not found"))?;
                *target = value.clone();
            }
            PatchOperation::Move { from, path } => {
                if path.starts_with(from.as_str()) && path.len() > from.len() {
                    return Err(fail("cannot move a value into itself"));
                }
                let v = remove(&mut work, from).map_err(fail)?;
                add(&mut work, path, v).map_err(fail)?;
            }
            PatchOperation::Copy { from, path } => {
                let v = work
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| fail("from not found"))?;
                add(&mut work, path, v).map_err(fail)?;
            }
            PatchOperation::Test { path, value } => {
                if work.pointer(path) != Some(value) {
                    return Err(fail("test failed"));
                }
            }
        }
    }
    *doc = work;
    Ok(())
}

fn split_parent(path: &str) -> Option<(&str, String)> {
    let idx = path.rfind('/')?;
    Some((&path[..idx], unescape(&path[idx + 1..])))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), &'static str> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, token) = split_parent(path).ok_or("malformed path")?;
    let target = doc.pointer_mut(parent).ok_or("parent not found")?;
    match target {
        Value::Object(map) => {
            map.insert(token, value);
            Ok(())
        }
        Value::Array(arr) => {
            if token == "-" {
                arr.push(value);
                return Ok(());
            }
            let i = parse_index(&token)?;
            if i > arr.len() {
                return Err("array index out of bounds");
            }
            arr.insert(i, value);
            Ok(())
        }
        _ => Err("parent is not a container"),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, &'static str> {
    let (parent, token) = split_parent(path).ok_or("cannot remove the root")?;
    let target = doc.pointer_mut(parent).ok_or("parent not found")?;
    match target {
        Value::Object(map) => map.remove(&token).ok_or("member not found"),
        Value::Array(arr) => {
            let i = parse_index(&token)?;
            if i >= arr.len() {
                return Err("array index out of bounds");
            }
            Ok(arr.remove(i))
        }
        _ => Err("parent is not a container"),
    }
}

fn parse_index(token: &str) -> Result<usize, &'static str> {
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return Err("invalid array index");
    }
    token.parse().map_err(|_| "invalid array index")
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
        assert_eq!(
            serde_json::to_value(&ops).unwrap(),
            json!([
                {"op": "replace", "path": "/1", "value": 5},
                {"op": "remove", "path": "/3"},
                {"op": "remove", "path": "/2"}
            ])
        );
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
