//! Property: any fragmentation of the same tool calls (random argument split points, random
//! grouping of fragments into chunks, interleaved indices, llama-cpp-python repeats) accumulates
//! to the same calls, and the emitted deltas describe them exactly (one start before any argument
//! piece, pieces concatenating to the arguments, one end).

use std::collections::HashMap;

use proptest::prelude::*;
use serde_json::{Value, json};
use tether_openai::{Emit, Fed, StreamAccumulator};

#[derive(Debug, Clone)]
struct Call {
    id: String,
    name: String,
    args: String,
}

fn calls() -> impl Strategy<Value = Vec<Call>> {
    prop::collection::vec(
        (
            "[a-z_]{1,12}",
            prop::collection::hash_map("[a-z]{1,6}", "[ -~é\n\"\\\\]{0,12}", 0..4),
        ),
        1..5,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (name, args))| Call {
                id: format!("call_{i}_{name}"),
                name,
                args: serde_json::to_string(&args).unwrap_or_default(),
            })
            .collect()
    })
}

/// One fragment: (call index, argument piece, whether it is the call's first).
type Frag = (usize, String, bool);

fn split(s: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    points.push(0);
    points.push(chars.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| chars[w[0]..w[1]].iter().collect())
        .collect()
}

fn fragment_json(call: &Call, index: usize, piece: &str, first: bool, llama: bool) -> Value {
    if first || llama {
        json!({"index": index, "id": call.id, "type": "function",
               "function": {"name": call.name, "arguments": piece}})
    } else {
        json!({"index": index, "function": {"arguments": piece}})
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_fragmentation_accumulates_to_the_same_calls(
        calls in calls(),
        cuts in prop::collection::vec(prop::collection::vec(0usize..64, 0..6), 5),
        order_seed in prop::collection::vec(0usize..8, 0..64),
        group_seed in prop::collection::vec(1usize..4, 1..64),
        llama in any::<bool>(),
        text_first in any::<bool>(),
    ) {
        // Per call: its fragments in order.
        let mut queues: Vec<Vec<Frag>> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                split(&c.args, &cuts[i])
                    .into_iter()
                    .enumerate()
                    .map(|(k, p)| (i, p, k == 0))
                    .rev()
                    .collect()
            })
            .collect();
        for q in queues.iter_mut() {
            if q.is_empty() {
                q.push((0, String::new(), true));
            }
        }
        for (i, q) in queues.iter_mut().enumerate() {
            for f in q.iter_mut() {
                f.0 = i;
            }
        }
        // Interleave: pick a non-empty queue by the seed, keeping each call's own order.
        let mut merged: Vec<Frag> = Vec::new();
        let mut s = 0;
        while queues.iter().any(|q| !q.is_empty()) {
            let live: Vec<usize> = (0..queues.len()).filter(|i| !queues[*i].is_empty()).collect();
            let pick = live[order_seed.get(s).copied().unwrap_or(0) % live.len()];
            s += 1;
            if let Some(f) = queues[pick].pop() {
                merged.push(f);
            }
        }
        // Group consecutive fragments into chunks (a chunk never holds the same index twice).
        let mut chunks: Vec<Vec<Frag>> = Vec::new();
        let mut g = 0;
        let mut it = merged.into_iter().peekable();
        while it.peek().is_some() {
            let size = group_seed[g % group_seed.len()];
            g += 1;
            let mut chunk: Vec<Frag> = Vec::new();
            while chunk.len() < size {
                match it.peek() {
                    Some(f) if !chunk.iter().any(|c| c.0 == f.0) => {
                        if let Some(f) = it.next() {
                            chunk.push(f);
                        }
                    }
                    _ => break,
                }
            }
            chunks.push(chunk);
        }
        let mut payloads: Vec<String> = Vec::new();
        if text_first {
            payloads.push(json!({"choices":[{"index":0,"delta":{"role":"assistant","content":"Let me check."}}]}).to_string());
        }
        for chunk in &chunks {
            let tcs: Vec<Value> = chunk
                .iter()
                .map(|(i, p, first)| fragment_json(&calls[*i], *i, p, *first, llama))
                .collect();
            let mut delta = json!({"tool_calls": tcs});
            if llama {
                delta["function_call"] = json!({"name": "bogus:", "arguments": "x"});
            }
            payloads.push(json!({"id":"c","choices":[{"index":0,"delta":delta,"finish_reason":null}]}).to_string());
        }
        payloads.push(json!({"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}).to_string());
        payloads.push(json!({"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}).to_string());
        payloads.push("[DONE]".into());

        let mut acc = StreamAccumulator::new();
        let mut started: Vec<String> = Vec::new();
        let mut ended: Vec<String> = Vec::new();
        let mut args: HashMap<String, String> = HashMap::new();
        let mut record = |acc: &StreamAccumulator, started: &mut Vec<String>, ended: &mut Vec<String>| {
            for e in acc.emits() {
                match e {
                    Emit::Start(s) => started.push(acc.calls()[*s].id.clone()),
                    Emit::Args(s, r) => {
                        let c = &acc.calls()[*s];
                        assert!(started.contains(&c.id), "args before start");
                        args.entry(c.id.clone()).or_default().push_str(&c.arguments[r.clone()]);
                    }
                    Emit::End(s) => ended.push(acc.calls()[*s].id.clone()),
                    Emit::Text(_) | Emit::Reasoning(_) => {}
                }
            }
        };
        let mut done = false;
        for p in &payloads {
            if acc.feed(p.as_bytes()).unwrap() == Fed::Done {
                done = true;
                break;
            }
            record(&acc, &mut started, &mut ended);
            acc.clear_emits();
        }
        prop_assert!(done);
        acc.finish().unwrap();
        record(&acc, &mut started, &mut ended);
        let resp = acc.into_response();

        let got: Vec<(String, String, String)> = resp
            .message
            .tool_calls
            .iter()
            .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone()))
            .collect();
        let want: Vec<(String, String, String)> =
            calls.iter().map(|c| (c.id.clone(), c.name.clone(), c.args.clone())).collect();
        prop_assert_eq!(&got, &want);
        let mut s_sorted = started.clone();
        s_sorted.sort();
        let mut w_ids: Vec<String> = calls.iter().map(|c| c.id.clone()).collect();
        w_ids.sort();
        prop_assert_eq!(s_sorted, w_ids.clone());
        prop_assert_eq!(ended, calls.iter().map(|c| c.id.clone()).collect::<Vec<_>>());
        for c in &calls {
            prop_assert_eq!(args.get(&c.id).map(String::as_str).unwrap_or(""), c.args.as_str());
        }
        prop_assert_eq!(resp.finish_reason.as_deref(), Some("tool_calls"));
        prop_assert_eq!(resp.usage.map(|u| u.output_tokens), Some(2));
        prop_assert_eq!(resp.message.content.as_deref(), if text_first { Some("Let me check.") } else { None });
    }
}
