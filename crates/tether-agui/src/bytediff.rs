//! A fast path for the state diff: two serializations of the same typed state usually share a
//! long prefix and a long suffix. The smallest JSON value that covers the bytes between them,
//! found with one forward scan up to the first difference, is replaced in one operation.
//!
//! This turns a one-leaf change in a 1 MiB state into two `memcmp`s, a scan of the prefix and
//! a tiny patch, instead of building and comparing two 1 MiB trees. It only applies when both
//! documents are compact JSON (as `serde_json::to_vec` writes them); the caller falls back to
//! the tree diff when it does not find a small enough replacement.

use serde_json::Value;

use crate::patch::PatchOperation;

#[derive(Debug)]
enum Tok {
    Key(usize, usize),
    Index(usize),
}

#[derive(Debug)]
struct Frame {
    start: usize,
    array: bool,
    index: usize,
    key: Option<(usize, usize)>,
}

/// End (exclusive) of the string starting at `i` (`doc[i] == b'"'`).
fn skip_string(doc: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        let at = i + memchr::memchr2(b'"', b'\\', doc.get(i..)?)?;
        if doc[at] == b'"' {
            return Some(at + 1);
        }
        i = at + 2;
    }
}

/// Length of the common prefix of `a` and `b`, compared a block at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Length of the common suffix of `a` and `b`, at most `max`.
fn common_suffix(a: &[u8], b: &[u8], max: usize) -> usize {
    const BLOCK: usize = 64;
    let (la, lb) = (a.len(), b.len());
    let mut k = 0;
    while k + BLOCK <= max && a[la - k - BLOCK..la - k] == b[lb - k - BLOCK..lb - k] {
        k += BLOCK;
    }
    while k < max && a[la - k - 1] == b[lb - k - 1] {
        k += 1;
    }
    k
}

/// End (exclusive) of the JSON value starting at `i` (compact or not).
fn skip_value(doc: &[u8], i: usize) -> Option<usize> {
    match *doc.get(i)? {
        b'"' => skip_string(doc, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < doc.len() {
                match doc[j] {
                    b'"' => {
                        j = skip_string(doc, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < doc.len() && !matches!(doc[j], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t') {
                j += 1;
            }
            Some(j)
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

/// Walks `doc` up to byte `p` and returns the chain of values containing `p`, innermost
/// first, each as (start offset, path).
fn containing(doc: &[u8], p: usize) -> Option<Vec<(usize, Vec<Tok>)>> {
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    let path_of = |stack: &[Frame]| -> Vec<Tok> {
        stack
            .iter()
            .filter_map(|f| {
                if f.array {
                    Some(Tok::Index(f.index))
                } else {
                    f.key.map(|(a, b)| Tok::Key(a, b))
                }
            })
            .collect()
    };
    let chain_from = |stack: &[Frame], inner: Option<(usize, Vec<Tok>)>| {
        let mut chain: Vec<(usize, Vec<Tok>)> = inner.into_iter().collect();
        for depth in (0..stack.len()).rev() {
            chain.push((stack[depth].start, path_of(&stack[..depth])));
        }
        chain
    };
    while i < doc.len() {
        if i >= p && !is_ws(doc[i]) && !matches!(doc[i], b',' | b':' | b'}' | b']') {
            // A value (or a key) starts at or after p.
            let expecting_key = stack.last().is_some_and(|f| !f.array && f.key.is_none());
            if expecting_key {
                return Some(chain_from(&stack, None));
            }
            return Some(chain_from(&stack, Some((i, path_of(&stack)))));
        }
        if i >= p {
            return Some(chain_from(&stack, None));
        }
        match doc[i] {
            b' ' | b'\n' | b'\r' | b'\t' => i += 1,
            b',' => {
                if let Some(f) = stack.last_mut() {
                    if f.array {
                        f.index += 1;
                    } else {
                        f.key = None;
                    }
                }
                i += 1;
            }
            b':' => i += 1,
            b'{' | b'[' => {
                stack.push(Frame {
                    start: i,
                    array: doc[i] == b'[',
                    index: 0,
                    key: None,
                });
                i += 1;
            }
            b'}' | b']' => {
                stack.pop();
                i += 1;
            }
            b'"' => {
                let end = skip_string(doc, i)?;
                let is_key = stack.last().is_some_and(|f| !f.array && f.key.is_none());
                if is_key {
                    if p < end {
                        // p is inside a key: the object is the innermost container.
                        return Some(chain_from(&stack, None));
                    }
                    if let Some(f) = stack.last_mut() {
                        f.key = Some((i, end));
                    }
                } else if p < end {
                    return Some(chain_from(&stack, Some((i, path_of(&stack)))));
                }
                i = end;
            }
            _ => {
                let end = skip_value(doc, i)?;
                if p < end {
                    return Some(chain_from(&stack, Some((i, path_of(&stack)))));
                }
                i = end;
            }
        }
    }
    Some(chain_from(&stack, None))
}

fn pointer(doc: &[u8], path: &[Tok]) -> Option<String> {
    let mut out = String::new();
    for t in path {
        out.push('/');
        match t {
            Tok::Index(n) => out.push_str(&n.to_string()),
            Tok::Key(a, b) => {
                let key: String = serde_json::from_slice(&doc[*a..*b]).ok()?;
                for c in key.chars() {
                    match c {
                        '~' => out.push_str("~0"),
                        '/' => out.push_str("~1"),
                        c => out.push(c),
                    }
                }
            }
        }
    }
    Some(out)
}

/// The single `replace` that turns JSON document `old` into `new`, when one covering at most
/// `max_value` bytes of `new` exists. `None`: documents equal (`Some(vec![])` is never
/// returned) or no small replacement — use the tree diff.
pub(crate) fn replace_patch(old: &[u8], new: &[u8], max_value: usize) -> Option<Vec<PatchOperation>> {
    if old == new {
        return None;
    }
    let prefix = common_prefix(old, new);
    let suffix = common_suffix(old, new, old.len().min(new.len()) - prefix);
    let mut chain = containing(new, prefix)?;
    if chain.last().is_none_or(|(start, _)| *start != 0) {
        chain.push((0, Vec::new()));
    }
    for (start, path) in chain {
        if start > prefix {
            continue;
        }
        let end_new = skip_value(new, start)?;
        let end_old = skip_value(old, start)?;
        let tail_new = new.len() - end_new;
        let tail_old = old.len() - end_old;
        if tail_new != tail_old || tail_new > suffix {
            continue;
        }
        // Outside [start, end) both documents are byte-identical: replacing that value is exact.
        if end_new - start > max_value {
            return None;
        }
        let value: Value = serde_json::from_slice(&new[start..end_new]).ok()?;
        let path = pointer(new, &path)?;
        return Some(vec![PatchOperation::Replace { path, value }]);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(a: Value, b: Value) -> Option<Vec<PatchOperation>> {
        let (x, y) = (serde_json::to_vec(&a).unwrap(), serde_json::to_vec(&b).unwrap());
        let ops = replace_patch(&x, &y, usize::MAX)?;
        let mut doc = a.clone();
        crate::patch::apply(&mut doc, &ops).unwrap();
        assert_eq!(doc, b);
        Some(ops)
    }

    proptest::proptest! {
        /// A serialized string of any length, with quotes and backslashes anywhere, ends where
        /// serde_json ended it.
        #[test]
        fn strings_end_where_they_end(
            s in proptest::prop_oneof![
                proptest::prelude::any::<String>(),
                "[\"\\\\a-z é]{0,80}",
            ]
        ) {
            let mut doc = serde_json::to_vec(&s).unwrap();
            let end = doc.len();
            doc.extend_from_slice(b",\"x\\\"y\"]");
            proptest::prop_assert_eq!(skip_string(&doc, 0), Some(end));
        }
    }

    #[test]
    fn one_leaf() {
        let a = json!({"items": [{"done": true, "id": 1}, {"done": false, "id": 2}], "t": "x"});
        let mut b = a.clone();
        b["items"][1]["done"] = json!(true);
        let ops = check(a, b).unwrap();
        assert_eq!(
            serde_json::to_value(&ops).unwrap(),
            json!([{"op": "replace", "path": "/items/1/done", "value": true}])
        );
    }

    #[test]
    fn number_growth_and_keys_and_escapes() {
        check(json!({"a": 12, "b": 1}), json!({"a": 123, "b": 1})).unwrap();
        check(json!({"a/~b": "x\"y"}), json!({"a/~b": "x\"z"})).unwrap();
        check(json!({"ab": 1}), json!({"ac": 1})).unwrap();
        check(json!([1, 2]), json!([1, 2, 3])).unwrap();
        check(json!({"a": [1]}), json!({"a": {"b": 1}})).unwrap();
        check(json!(1), json!("one")).unwrap();
        check(json!(12), json!(1)).unwrap();
        check(json!([1, 2, 3]), json!([1, 2])).unwrap();
        assert!(check(json!({"a": 1}), json!({"a": 1})).is_none());
    }
}
