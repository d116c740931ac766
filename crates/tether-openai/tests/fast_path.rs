//! Property: the hand-written fast path for common chunks (`src/fast.rs`) plus the serde fallback
//! accumulates exactly what the serde parse alone does — text, reasoning, calls, finish reason,
//! emits after every chunk, errors, and the final raw response — for generated streams of chunks
//! with random key order and whitespace, optional extra fields, content with escapes, control
//! characters and non-ASCII text, and shapes the fast path must leave alone (tool calls, usage,
//! errors, several choices, other indices, nested unknown values, duplicates), plus random byte
//! mutations of those lines.

use proptest::prelude::*;
use tether_openai::StreamAccumulator;

/// A JSON tree whose objects keep their key order as generated.
#[derive(Debug, Clone)]
enum J {
    Raw(String),
    Obj(Vec<(String, J)>),
    Arr(Vec<J>),
}

/// A small deterministic generator for key order and whitespace, seeded by proptest.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn render(j: &J, rng: &mut Lcg, out: &mut String) {
    let ws = |rng: &mut Lcg, out: &mut String| {
        out.push_str(match rng.next() % 8 {
            0 => " ",
            1 => "\n",
            2 => "\t ",
            3 => "\r\n ",
            _ => "",
        })
    };
    match j {
        J::Raw(s) => out.push_str(s),
        J::Obj(entries) => {
            let mut e: Vec<&(String, J)> = entries.iter().collect();
            // Fisher-Yates: any key order.
            for i in (1..e.len()).rev() {
                let k = (rng.next() as usize) % (i + 1);
                e.swap(i, k);
            }
            out.push('{');
            for (n, (k, v)) in e.into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                ws(rng, out);
                out.push_str(k);
                ws(rng, out);
                out.push(':');
                ws(rng, out);
                render(v, rng, out);
                ws(rng, out);
            }
            out.push('}');
        }
        J::Arr(items) => {
            out.push('[');
            for (n, v) in items.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                ws(rng, out);
                render(v, rng, out);
            }
            ws(rng, out);
            out.push(']');
        }
    }
}

fn key(k: &str) -> String {
    format!("\"{k}\"")
}

fn raw(s: &str) -> J {
    J::Raw(s.to_owned())
}

/// A JSON string literal for `text`, each character written raw or escaped at random
/// (short escapes, `\uXXXX`, surrogate pairs), from `modes` (one per character).
fn encode(text: &str, modes: &[u8]) -> String {
    let mut out = String::from("\"");
    for (i, c) in text.chars().enumerate() {
        let m = modes.get(i).copied().unwrap_or(0) % 3;
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str(if m == 0 { "\\\\" } else { "\\u005c" }),
            '\n' if m != 2 => out.push_str("\\n"),
            '\t' if m != 2 => out.push_str("\\t"),
            '/' if m == 1 => out.push_str("\\/"),
            c if (c as u32) < 0x20 || m == 2 => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        "[a-z ]{0,8}",
        "[ -~]{0,12}",
        "[\"\\\\/\n\t\u{1}a-zé€😀]{0,10}",
        any::<String>(),
    ]
    .boxed()
}

/// A string value: encoded text, or null, or (rarely) something invalid.
fn str_value() -> BoxedStrategy<J> {
    prop_oneof![
        6 => (text(), prop::collection::vec(any::<u8>(), 0..16)).prop_map(|(t, m)| J::Raw(encode(&t, &m))),
        2 => Just(raw("null")),
        1 => Just(raw("\"\\ud800\"")),
        1 => Just(raw("\"a\\x\"")),
        1 => Just(raw("\"ctl\u{1}\"")),
        1 => Just(raw("7")),
    ]
    .boxed()
}

/// An extra field, scalar or not, known to no chunk type (or `usage`/`error`).
fn extra() -> impl Strategy<Value = (String, J)> {
    prop_oneof![
        Just((key("object"), raw("\"chat.completion.chunk\""))),
        Just((key("created"), raw("1764000000"))),
        Just((key("created"), raw("-0"))),
        Just((key("created"), raw("1.5e3"))),
        Just((key("created"), raw("012"))),
        Just((key("system_fingerprint"), raw("\"fp_44709d6fcb\""))),
        Just((key("obfuscation"), raw("\"x\\\"Yz\\u00e9\""))),
        Just((key("service_tier"), raw("null"))),
        Just((key("flag"), raw("true"))),
        Just((key("flag"), raw("false"))),
        Just((key("logprobs"), raw("{\"content\":[{\"token\":\"a\"}]}"))),
        Just((key("list"), raw("[1,2]"))),
        Just((key("usage"), raw("null"))),
        Just((
            key("usage"),
            raw("{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}")
        )),
        Just((key("error"), raw("null"))),
        Just((
            key("error"),
            raw("{\"message\":\"overloaded\",\"type\":\"server_error\"}")
        )),
        Just((key("\\u0069d"), raw("\"escaped-key\""))),
        Just((key("é"), raw("1"))),
    ]
}

fn delta() -> BoxedStrategy<J> {
    (
        prop::option::of(str_value()),
        prop::option::weighted(0.15, str_value()),
        prop::option::weighted(0.15, str_value()),
        prop::option::weighted(0.1, str_value()),
        prop::option::weighted(0.2, Just(raw("\"assistant\""))),
        prop::option::weighted(
            0.1,
            prop_oneof![
                Just(raw("null")),
                Just(raw("[]")),
                Just(raw(
                    "[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]"
                )),
            ],
        ),
        prop::option::weighted(
            0.05,
            prop_oneof![
                Just(raw("null")),
                Just(raw("{\"name\":\"g\",\"arguments\":\"{\\\"a\\\":1}\"}"))
            ],
        ),
        prop::option::weighted(0.05, str_value()),
    )
        .prop_map(|(content, refusal, rc, r, role, tc, fc, dup)| {
            let mut e = Vec::new();
            let mut put = |k: &str, v: Option<J>| {
                if let Some(v) = v {
                    e.push((key(k), v));
                }
            };
            put("content", content);
            put("refusal", refusal);
            put("reasoning_content", rc);
            put("reasoning", r);
            put("role", role);
            put("tool_calls", tc);
            put("function_call", fc);
            // A duplicate key, which serde rejects.
            put("content", dup);
            J::Obj(e)
        })
    .boxed()
}

fn choice() -> BoxedStrategy<J> {
    (
        prop_oneof![
            6 => Just(Some(raw("0"))),
            2 => Just(None),
            1 => Just(Some(raw("1"))),
            1 => Just(Some(raw("0.0"))),
        ],
        prop_oneof![8 => delta().prop_map(Some), 1 => Just(Some(raw("null"))), 1 => Just(None)],
        prop_oneof![
            6 => Just(Some(raw("null"))),
            2 => Just(None),
            1 => Just(Some(raw("\"\""))),
            1 => Just(Some(raw("\"stop\""))),
            1 => Just(Some(raw("\"length\""))),
        ],
        prop::option::weighted(0.3, Just(raw("null"))),
    )
        .prop_map(|(index, delta, finish, logprobs)| {
            let mut e = Vec::new();
            for (k, v) in [
                ("index", index),
                ("delta", delta),
                ("finish_reason", finish),
                ("logprobs", logprobs),
            ] {
                if let Some(v) = v {
                    e.push((key(k), v));
                }
            }
            J::Obj(e)
        })
        .boxed()
}

fn chunk_tree() -> BoxedStrategy<J> {
    (
        prop::option::weighted(0.8, prop_oneof![Just(raw("\"chatcmpl-abc\"")), Just(raw("null"))]),
        prop::option::weighted(0.6, prop_oneof![Just(raw("\"gpt-x\"")), Just(raw("null"))]),
        prop_oneof![
            12 => choice().prop_map(|c| Some(J::Arr(vec![c]))),
            1 => Just(Some(raw("null"))),
            1 => Just(Some(raw("[]"))),
            1 => Just(None),
            1 => (choice(), choice()).prop_map(|(a, b)| Some(J::Arr(vec![a, b]))),
        ],
        prop::collection::vec(extra(), 0..4),
    )
        .prop_map(|(id, model, choices, extras)| {
            let mut e = Vec::new();
            for (k, v) in [("id", id), ("model", model), ("choices", choices)] {
                if let Some(v) = v {
                    e.push((key(k), v));
                }
            }
            e.extend(extras);
            J::Obj(e)
        })
        .boxed()
}

fn line(j: &J, seed: u64) -> String {
    let mut rng = Lcg(seed);
    let mut out = String::new();
    render(j, &mut rng, &mut out);
    out
}

/// A mutation of a line: delete, replace or insert one byte.
fn mutate(line: &str, at: usize, op: u8, byte: u8) -> Vec<u8> {
    let mut b = line.as_bytes().to_vec();
    if b.is_empty() {
        return b;
    }
    let at = at % b.len();
    const SIGNIFICANT: &[u8] = b"{}[]\",:\\ 0-1.enul\x01\xff\xc3";
    let byte = SIGNIFICANT[byte as usize % SIGNIFICANT.len()];
    match op % 3 {
        0 => {
            b.remove(at);
        }
        1 => b[at] = byte,
        _ => b.insert(at, byte),
    }
    b
}

/// Feeds the same payloads to a fast-path accumulator and a serde-only one, comparing everything
/// observable after every payload.
fn same(payloads: &[Vec<u8>]) -> Result<(), TestCaseError> {
    let mut fast = StreamAccumulator::new();
    let mut full = StreamAccumulator::new();
    for (n, p) in payloads.iter().enumerate() {
        let a = fast.feed_with(p, true).map_err(|e| e.to_string());
        let b = full.feed_with(p, false).map_err(|e| e.to_string());
        let shown = String::from_utf8_lossy(p);
        prop_assert_eq!(&a, &b, "payload #{}: {}", n, shown);
        prop_assert_eq!(fast.emits(), full.emits(), "payload #{}: {}", n, shown);
        prop_assert_eq!(fast.text(), full.text());
        prop_assert_eq!(fast.reasoning(), full.reasoning());
        prop_assert_eq!(fast.calls(), full.calls());
        prop_assert_eq!(fast.finish_reason(), full.finish_reason());
        prop_assert_eq!(fast.events(), full.events());
        if a.is_err() {
            // The stream ends at an error, as in `read_stream`.
            break;
        }
        fast.clear_emits();
        full.clear_emits();
    }
    let (a, b) = (fast.into_response(), full.into_response());
    prop_assert_eq!(a.raw, b.raw);
    prop_assert_eq!(a.message.content, b.message.content);
    prop_assert_eq!(a.message.reasoning, b.message.reasoning);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn fast_path_accumulates_like_serde(
        chunks in prop::collection::vec((chunk_tree(), any::<u64>()), 1..12),
    ) {
        let payloads: Vec<Vec<u8>> = chunks.iter().map(|(j, s)| line(j, *s).into_bytes()).collect();
        same(&payloads)?;
    }

    #[test]
    fn mutated_lines_agree(
        tree in chunk_tree(),
        seed in any::<u64>(),
        muts in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..3),
    ) {
        let base = line(&tree, seed);
        let mut p = base.clone().into_bytes();
        for (at, op, byte) in muts {
            p = mutate(&String::from_utf8_lossy(&p), at, op, byte);
        }
        same(&[base.into_bytes(), p])?;
    }
}

const PLACEHOLDER: &str = "@@CONTENT@@";

/// `tree` with the value of every `content` key of its first choice's delta replaced by the
/// placeholder (so lines can be rendered again with other contents, byte for byte the same
/// otherwise); `false` when it has none.
fn with_placeholder(tree: &mut J) -> bool {
    let mut found = false;
    if let J::Obj(top) = tree {
        for (k, v) in top.iter_mut() {
            if k == "\"choices\""
                && let J::Arr(items) = v
                && let Some(J::Obj(choice)) = items.first_mut()
            {
                for (k, v) in choice.iter_mut() {
                    if k == "\"delta\""
                        && let J::Obj(delta) = v
                    {
                        for (k, v) in delta.iter_mut() {
                            if k == "\"content\"" {
                                *v = raw(PLACEHOLDER);
                                found = true;
                            }
                        }
                    }
                }
            }
        }
    }
    found
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Streams where most lines are one template with another content (as servers send them),
    /// so the fast path's template reuse is exercised, with other chunks and mutations mixed in.
    #[test]
    fn templated_streams_accumulate_like_serde(
        templates in prop::collection::vec((chunk_tree(), any::<u64>()), 1..3),
        steps in prop::collection::vec(
            (0..10u8, text(), prop::collection::vec(any::<u8>(), 0..16), chunk_tree(), any::<u64>(), (any::<usize>(), any::<u8>(), any::<u8>())),
            1..24,
        ),
    ) {
        let rendered: Vec<String> = templates
            .into_iter()
            .map(|(mut t, seed)| {
                if !with_placeholder(&mut t) {
                    // Give it a content: a template must have one to be reused.
                    t = J::Obj(vec![(key("choices"), J::Arr(vec![J::Obj(vec![(key("delta"), J::Obj(vec![(key("content"), raw(PLACEHOLDER))]))])]))]);
                }
                line(&t, seed)
            })
            .collect();
        let mut payloads = Vec::new();
        for (kind, t, modes, other, seed, (at, op, byte)) in steps {
            let content = encode(&t, &modes);
            let templ = &rendered[kind as usize % rendered.len()];
            payloads.push(match kind {
                0 => line(&other, seed).into_bytes(),
                1 => mutate(&templ.replace(PLACEHOLDER, &content), at, op, byte),
                2 => templ.replace(PLACEHOLDER, "null").into_bytes(),
                _ => templ.replace(PLACEHOLDER, &content).into_bytes(),
            });
        }
        same(&payloads)?;
    }
}

/// The common shapes do take the fast path (otherwise the properties above would hold
/// trivially), and accumulate the expected text.
#[test]
fn content_chunks_take_the_fast_path() {
    let lines = [
        r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"content":"hi \"there\"\n\u00e9😀"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"q1"}"#,
        r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"content":" world"}}],"created":1,"id":"x","model":"llama","object":"chat.completion.chunk"}"#,
        r#"{"id":"x","choices":[{"index":0,"delta":{"reasoning_content":"hm","content":null}}]}"#,
    ];
    let mut a = StreamAccumulator::new();
    for l in lines {
        assert!(tether_openai::fast_path_accepts(l.as_bytes()), "{l}");
        a.feed(l.as_bytes()).unwrap();
    }
    assert_eq!(a.text(), "hi \"there\"\né😀 world");
    assert_eq!(a.reasoning(), "hm");
}

proptest! {
    /// Most generated chunks are of the common shape, so the properties exercise the fast path.
    #[test]
    fn generated_content_chunks_are_accepted(t in text(), m in prop::collection::vec(any::<u8>(), 0..16), seed in any::<u64>()) {
        let tree = J::Obj(vec![
            (key("id"), raw("\"c\"")),
            (key("object"), raw("\"chat.completion.chunk\"")),
            (key("choices"), J::Arr(vec![J::Obj(vec![
                (key("index"), raw("0")),
                (key("delta"), J::Obj(vec![(key("content"), J::Raw(encode(&t, &m)))])),
                (key("finish_reason"), raw("null")),
            ])])),
        ]);
        let l = line(&tree, seed);
        prop_assert!(tether_openai::fast_path_accepts(l.as_bytes()), "{}", l);
    }
}

/// Feeds `reads` through `feed_read` (the stream loop, with whole-event template runs) and
/// through a line-by-line serde-only loop, comparing everything after every read.
fn same_reads(reads: &[Vec<u8>]) -> Result<(), TestCaseError> {
    use tether_openai::{Fed, LineSplitter, data_of, feed_read};
    let (mut fast, mut full) = (StreamAccumulator::new(), StreamAccumulator::new());
    let (mut lf, mut ls) = (LineSplitter::new(), LineSplitter::new());
    for (n, r) in reads.iter().enumerate() {
        lf.push(bytes::Bytes::copy_from_slice(r));
        ls.push(bytes::Bytes::copy_from_slice(r));
        let a = feed_read(&mut lf, &mut fast).map_err(|e| e.to_string());
        let b = (|| {
            while let Some(line) = ls.next_line() {
                if let Some(data) = data_of(line)
                    && full.feed_with(data, false)? == Fed::Done
                {
                    return Ok(Fed::Done);
                }
            }
            Ok::<_, tether::Error>(Fed::More)
        })()
        .map_err(|e| e.to_string());
        prop_assert_eq!(&a, &b, "read #{}", n);
        prop_assert_eq!(fast.emits(), full.emits(), "read #{}", n);
        prop_assert_eq!(fast.text(), full.text());
        prop_assert_eq!(fast.reasoning(), full.reasoning());
        prop_assert_eq!(fast.events(), full.events());
        prop_assert_eq!(lf.pending_len(), ls.pending_len());
        if a.is_err() || a == Ok(Fed::Done) {
            return Ok(());
        }
        fast.clear_emits();
        full.clear_emits();
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The stream loop's whole-event template runs read exactly what line-by-line feeding does,
    /// however the events are framed (LF, CRLF, CR, comments, a space or none after `data:`,
    /// trailing blanks) and split into reads.
    #[test]
    fn stream_reads_agree(
        template in (chunk_tree(), any::<u64>()),
        steps in prop::collection::vec(
            (0..12u8, text(), prop::collection::vec(any::<u8>(), 0..8), chunk_tree(), any::<u64>(), 0..10u8),
            1..40,
        ),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let (mut t, seed) = template;
        if seed % 2 == 0 {
            // Half the time the common shape, so the template is certainly taken.
            t = J::Obj(vec![
                (key("id"), raw("\"chatcmpl-1\"")),
                (key("object"), raw("\"chat.completion.chunk\"")),
                (key("created"), raw("1764000000")),
                (key("model"), raw("\"m\"")),
                (key("choices"), J::Arr(vec![J::Obj(vec![
                    (key("index"), raw("0")),
                    (key("delta"), J::Obj(vec![(key("content"), raw(PLACEHOLDER))])),
                    (key("logprobs"), raw("null")),
                    (key("finish_reason"), raw("null")),
                ])])),
            ]);
        } else if !with_placeholder(&mut t) {
            t = J::Obj(vec![(key("choices"), J::Arr(vec![J::Obj(vec![(key("delta"), J::Obj(vec![(key("content"), raw(PLACEHOLDER))]))])]))]);
        }
        // One line per event: the JSON whitespace the renderer puts between tokens, minus CR/LF
        // (strings have none raw: `encode` escapes control characters).
        let one_line = |s: String| s.replace(['\n', '\r'], " ");
        let templ = one_line(line(&t, seed));
        let mut all = Vec::new();
        for (kind, text, modes, other, seed, framing) in steps {
            let payload = match kind {
                0 => one_line(line(&other, seed)),
                1 => "[DONE]".to_owned(),
                2 => templ.replace(PLACEHOLDER, "null"),
                _ => templ.replace(PLACEHOLDER, &encode(&text, &modes)),
            };
            let ev = match framing {
                0 => format!("data:{payload}\r\n\r\n"),
                1 => format!("data: {payload}\r\r"),
                2 => format!(": keep-alive\ndata: {payload}\n\n"),
                3 => format!("data: {payload} \n\n"),
                4 => format!("data: {payload}\n"),
                5 => format!("data: {payload}}}\n\n"),
                _ => format!("data: {payload}\n\n"),
            };
            all.extend_from_slice(ev.as_bytes());
        }
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(all.len() + 1)).collect();
        points.push(0);
        points.push(all.len());
        points.sort_unstable();
        points.dedup();
        let reads: Vec<Vec<u8>> = points.windows(2).map(|w| all[w[0]..w[1]].to_vec()).collect();
        same_reads(&reads)?;
    }
}

#[test]
fn template_runs_are_taken_whole() {
    let mut a = StreamAccumulator::new();
    let l = |c: &str| {
        format!(r#"{{"id":"x","choices":[{{"index":0,"delta":{{"content":"{c}"}},"finish_reason":null}}]}}"#)
    };
    a.feed(l("a").as_bytes()).unwrap();
    let buf = format!("data: {}\n\ndata: {}\n\ndata: [DONE]\n\n", l("b"), l("c\\n"));
    let n = a.feed_templated(buf.as_bytes());
    assert_eq!(&buf[n..], "data: [DONE]\n\n");
    assert_eq!(a.text(), "abc\n");
    assert_eq!(a.events(), 3);
    // Not an event of the template: a line with more after it, or one cut short.
    for other in [
        format!("data: {}}}\n\n", l("d")),
        format!("data: {} \n\n", l("d")),
        format!("data: {}", l("d")),
    ] {
        assert_eq!(a.feed_templated(other.as_bytes()), 0, "{other}");
    }
}
