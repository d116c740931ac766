//! Encoding benchmark (a benchmark, not a test): `cargo bench -p tether-agui --bench encode`.
//!
//! 1. 100,000 `TEXT_MESSAGE_CONTENT` events to SSE: tether-agui vs the `ag-ui` crate
//!    (0.5.0-alpha.3, `SseFormatter::encode`). Goal: >= 1.5x.
//! 2. The same events to length-prefixed protobuf frames: tether-agui vs a plain `prost`
//!    encode of the same `ag_ui.Event` messages. Goal: >= 1.5x.
//! 3. `STATE_DELTA` generation for a 1 MiB state with one changed leaf. Goal: <= 1 ms.
//!
//! Each measurement is the best of several rounds, to keep noise from other processes down.

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether_agui::{AgUiEvent, Encoding, proto, state_update, state_update_json};

const N: usize = 100_000;
const ROUNDS: usize = 11;

fn best(mut f: impl FnMut() -> usize) -> (Duration, usize) {
    let mut best = Duration::MAX;
    let mut bytes = 0;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        bytes = black_box(f());
        best = best.min(t.elapsed());
    }
    (best, bytes)
}

/// Best times of `a` and `b`, measured in alternating rounds so both see the same load.
fn versus(
    mut a: impl FnMut() -> usize,
    mut b: impl FnMut() -> usize,
) -> ((Duration, usize), (Duration, usize)) {
    let (mut ta, mut tb) = (Duration::MAX, Duration::MAX);
    let (mut na, mut nb) = (0, 0);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        na = black_box(a());
        ta = ta.min(t.elapsed());
        let t = Instant::now();
        nb = black_box(b());
        tb = tb.min(t.elapsed());
    }
    ((ta, na), (tb, nb))
}

fn deltas() -> Vec<String> {
    (0..N)
        .map(|i| format!("token {i} of a streamed answer, with \"quotes\" and unicode é "))
        .collect()
}

mod pb {
    //! The same messages, as plain prost structs (field numbers of the 1.0 wire).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct BaseEvent {
        #[prost(int32, tag = "1")]
        pub r#type: i32,
        #[prost(int64, optional, tag = "2")]
        pub timestamp: Option<i64>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TextMessageContentEvent {
        #[prost(message, optional, tag = "1")]
        pub base_event: Option<BaseEvent>,
        #[prost(string, tag = "2")]
        pub message_id: String,
        #[prost(string, tag = "3")]
        pub delta: String,
    }
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(message, tag = "2")]
        TextMessageContent(TextMessageContentEvent),
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Event {
        #[prost(oneof = "Kind", tags = "2")]
        pub event: Option<Kind>,
    }
}

fn sse(deltas: &[String]) -> (f64, f64) {
    let ours: Vec<AgUiEvent> = deltas
        .iter()
        .map(|d| AgUiEvent::text_message_content("msg-1", d.as_str()))
        .collect();
    let theirs: Vec<ag_ui::Event> = deltas
        .iter()
        .map(|d| ag_ui::Event::text_message_content("msg-1", d.as_str()))
        .collect();
    // Same bytes on the wire.
    let mut a = Vec::new();
    Encoding::Sse.encode_into(&ours[7], &mut a).unwrap();
    let b =
        ag_ui::encode::EventStreamFormatter::encode(&ag_ui::encode::sse::SseFormatter, &theirs[7]).unwrap();
    assert_eq!(a, b, "both encoders must produce the same frame");

    let fmt = ag_ui::encode::sse::SseFormatter;
    let ((t_ours, bytes_ours), (t_theirs, bytes_theirs)) = versus(
        || {
            // As the server does: frames appended to a reused response buffer.
            let mut buf = Vec::with_capacity(64 * 1024);
            let mut total = 0;
            for e in &ours {
                Encoding::Sse.encode_into(e, &mut buf).unwrap();
                if buf.len() > 60 * 1024 {
                    total += buf.len();
                    black_box(&buf);
                    buf.clear();
                }
            }
            total + buf.len()
        },
        || {
            let mut total = 0;
            for e in &theirs {
                let frame = ag_ui::encode::EventStreamFormatter::encode(&fmt, e).unwrap();
                total += frame.len();
                black_box(frame);
            }
            total
        },
    );
    assert_eq!(bytes_ours, bytes_theirs);
    (t_ours.as_secs_f64(), t_theirs.as_secs_f64())
}

fn protobuf(deltas: &[String]) -> (f64, f64, f64) {
    let ours: Vec<AgUiEvent> = deltas
        .iter()
        .map(|d| AgUiEvent::text_message_content("msg-1", d.as_str()))
        .collect();
    let theirs: Vec<pb::Event> = deltas
        .iter()
        .map(|d| pb::Event {
            event: Some(pb::Kind::TextMessageContent(pb::TextMessageContentEvent {
                base_event: Some(pb::BaseEvent {
                    r#type: 1,
                    timestamp: None,
                }),
                message_id: "msg-1".into(),
                delta: d.clone(),
            })),
        })
        .collect();
    let prost_frame = |m: &pb::Event, buf: &mut Vec<u8>| {
        use prost::Message;
        let len = m.encoded_len();
        buf.extend_from_slice(&(len as u32).to_be_bytes());
        m.encode(buf).unwrap();
    };
    let mut a = Vec::new();
    proto::encode_frame_into(&ours[7], &mut a);
    let mut b = Vec::new();
    prost_frame(&theirs[7], &mut b);
    assert_eq!(a, b, "both encoders must produce the same frame");

    let ours_run = || {
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut total = 0;
        for e in &ours {
            proto::encode_frame_into(e, &mut buf);
            if buf.len() > 60 * 1024 {
                total += buf.len();
                black_box(&buf);
                buf.clear();
            }
        }
        total + buf.len()
    };
    // Plain prost usage: `encode_to_vec` per message, then the frame.
    let plain_run = || {
        use prost::Message;
        let mut total = 0;
        for m in &theirs {
            let body = m.encode_to_vec();
            let mut frame = Vec::with_capacity(body.len() + 4);
            frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
            frame.extend_from_slice(&body);
            total += frame.len();
            black_box(frame);
        }
        total
    };
    // prost at its best: every frame into one reused buffer, like ours.
    let reused_run = || {
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut total = 0;
        for m in &theirs {
            prost_frame(m, &mut buf);
            if buf.len() > 60 * 1024 {
                total += buf.len();
                black_box(&buf);
                buf.clear();
            }
        }
        total + buf.len()
    };
    let ((t_ours, n1), (t_plain, n2)) = versus(ours_run, plain_run);
    let ((t_ours2, _), (t_theirs, n3)) = versus(ours_run, reused_run);
    assert_eq!(n1, n2);
    assert_eq!(n1, n3);
    let t_ours = t_ours.min(t_ours2);
    (
        t_ours.as_secs_f64(),
        t_theirs.as_secs_f64(),
        t_plain.as_secs_f64(),
    )
}

#[derive(Clone, Serialize, Deserialize, Default)]
struct Item {
    id: u64,
    name: String,
    done: bool,
    tags: Vec<String>,
}

#[derive(Clone, Serialize, Deserialize, Default)]
struct Big {
    title: String,
    items: Vec<Item>,
}

struct StateFigures {
    size: usize,
    /// `state_update_json` on the two serialized states (what `publish_state` runs).
    delta: f64,
    /// The same, plus serializing the typed state (the whole `publish_state`).
    typed: f64,
    /// The tree diff of the same states as `serde_json::Value`s, for reference.
    tree: f64,
    patch: String,
}

fn state() -> StateFigures {
    let mut big = Big {
        title: "board".into(),
        items: Vec::new(),
    };
    let mut i = 0;
    while serde_json::to_vec(&big).unwrap().len() < 1 << 20 {
        for _ in 0..512 {
            big.items.push(Item {
                id: i,
                name: format!("task number {i} with a reasonably long name"),
                done: i % 3 == 0,
                tags: vec!["alpha".into(), "beta".into()],
            });
            i += 1;
        }
    }
    let old_bytes = serde_json::to_vec(&big).unwrap();
    let mut changed = big.clone();
    let mid = changed.items.len() / 2;
    changed.items[mid].done = !changed.items[mid].done;
    let new_bytes = serde_json::to_vec(&changed).unwrap();

    let mut patch = String::new();
    let (delta, _) = best(|| {
        let e = state_update_json(Some(&old_bytes), &new_bytes).unwrap().unwrap();
        match &e {
            AgUiEvent::StateDelta(d) => patch = serde_json::to_string(&d.delta).unwrap(),
            other => panic!("expected a STATE_DELTA, got {}", other.event_type()),
        }
        1
    });
    let (typed, _) = best(|| {
        let v = serde_json::to_vec(&changed).unwrap();
        usize::from(black_box(state_update_json(Some(&old_bytes), &v).unwrap()).is_some())
    });
    let old: Value = serde_json::from_slice(&old_bytes).unwrap();
    let new: Value = serde_json::from_slice(&new_bytes).unwrap();
    let (tree, _) = best(|| usize::from(state_update(Some(&old), &new).unwrap().is_some()));
    StateFigures {
        size: old_bytes.len(),
        delta: delta.as_secs_f64(),
        typed: typed.as_secs_f64(),
        tree: tree.as_secs_f64(),
        patch,
    }
}

fn main() {
    let deltas = deltas();
    let (ours, theirs) = sse(&deltas);
    println!(
        "SSE       {N} TEXT_MESSAGE_CONTENT: tether-agui {:>7.2} ms, ag-ui 0.5.0-alpha.3 {:>7.2} ms, ratio {:.2}x (goal >= 1.5x)",
        ours * 1e3,
        theirs * 1e3,
        theirs / ours
    );
    let (ours, reused, plain) = protobuf(&deltas);
    println!(
        "protobuf  {N} TEXT_MESSAGE_CONTENT: tether-agui {:>7.2} ms, prost 0.13 encode_to_vec {:>7.2} ms, ratio {:.2}x (goal >= 1.5x); \
         prost into one reused buffer {:>7.2} ms, ratio {:.2}x",
        ours * 1e3,
        plain * 1e3,
        plain / ours,
        reused * 1e3,
        reused / ours
    );
    let f = state();
    println!(
        "STATE_DELTA for a {:.2} MiB state, one changed leaf: {:.3} ms (goal <= 1 ms); {:.3} ms including serializing the typed state; \
         tree diff of the same states as Values {:.3} ms; patch {}",
        f.size as f64 / (1 << 20) as f64,
        f.delta * 1e3,
        f.typed * 1e3,
        f.tree * 1e3,
        f.patch
    );
}
