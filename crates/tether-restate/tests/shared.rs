//! The shared record (`tether_restate::shared`): threads' records in a real PostgreSQL (the
//! machine's, `tether_testkit::postgres`) instead of Restate's object state. The scenarios of
//! `restate.rs` run on it too (`TETHER_RESTATE_RECORD=shared`); these check what only it does.

mod common;

use common::*;
use serde_json::json;
use tether::{Event, EventKind, EventStore, ThreadId, ThreadStore};
use tether_restate::SharedRecord;
use tether_restate::shared::{Start, Write};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tether_testkit::postgres::Postgres;

fn event(seq: u64, id: &str, text: &str) -> Event {
    let mut e = Event::new(id, "test.note", json!({"text": text}), EventKind::Other);
    e.seq = Some(seq);
    e
}

fn thread(id: &str, updated_ms: i64) -> tether::Thread {
    tether::Thread::new(ThreadId::new(id).expect("an id"), "demo", id, 1_000).with_updated_ms(updated_ms)
}

/// Writes sent together are batched, and two writes of one thread in one batch both land, in
/// order (one statement cannot update a row twice: the batch is split there); a write repeated
/// (a replayed turn) changes nothing; readers page the record in order and never past its length.
#[tokio::test(flavor = "multi_thread")]
async fn writes_batch_repeat_and_read_back_in_order() {
    let pg = Postgres::start().await;
    let record = SharedRecord::connect(&pg.connection()).await.expect("connect");
    // Connecting again (a second node) finds the tables there.
    let again = SharedRecord::connect(&pg.connection())
        .await
        .expect("connect again");

    let first = Write::new(thread("t-a", 2_000), 2)
        .events(vec![event(1, "e1", "one"), event(2, "e2", "two")])
        .marks(
            Some("inv-1".into()),
            Some("m1".into()),
            Some("http://127.0.0.1:9/n".into()),
        );
    let second = Write::new(thread("t-a", 3_000), 3)
        .events(vec![event(3, "e3", "three")])
        .checkpoint(Some(json!({"at": 3})))
        .marks(None, Some("m1".into()), None);
    let other = Write::new(thread("t-b", 2_500), 1).events(vec![event(1, "b1", "bee")]);
    let (a, b, c) = tokio::join!(
        record.write(first.clone()),
        record.write(second.clone()),
        again.write(other)
    );
    a.expect("first");
    b.expect("second");
    c.expect("other");
    // A replay writes the same again: nothing changes.
    record.write(first).await.expect("replayed first");
    record.write(second).await.expect("replayed second");

    let id = ThreadId::new("t-a").expect("an id");
    let status = again.status(&id).await.expect("status");
    assert_eq!(status.length, 3, "{status:?}");
    assert_eq!(status.invocation, None, "the turn ended: {status:?}");
    assert_eq!(status.message.as_deref(), Some("m1"));
    assert_eq!(status.thread.as_ref().map(|t| t.updated_ms), Some(3_000));
    let all = again.events_after("t-a", 0, 128).await.expect("events");
    let ids: Vec<&str> = all.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["e1", "e2", "e3"]);
    assert_eq!(again.events_after("t-a", 1, 1).await.expect("a page")[0].id, "e2");
    assert!(
        again
            .events_after("t-a", 3, 10)
            .await
            .expect("past the end")
            .is_empty()
    );
    assert_eq!(again.events_upto("t-a", 2).await.expect("upto").len(), 2);
    assert!(
        again.events_upto("t-a", 4).await.is_err(),
        "a record shorter than asked is an error"
    );
    assert_eq!(
        again.checkpoint("t-a").await.expect("checkpoint"),
        Some(json!({"at": 3}))
    );
    // A write without a checkpoint keeps the one written before.
    record
        .write(Write::new(thread("t-a", 4_000), 3))
        .await
        .expect("a write without a checkpoint");
    assert_eq!(
        again.checkpoint("t-a").await.expect("checkpoint"),
        Some(json!({"at": 3}))
    );
    // Listed by agent, the most recently used first.
    let listed: Vec<String> = again
        .threads(&["demo"])
        .await
        .expect("threads")
        .into_iter()
        .map(|t| t.id.to_string())
        .collect();
    assert_eq!(listed, ["t-a", "t-b"]);
    assert!(again.threads(&["nobody"]).await.expect("none").is_empty());
    assert_eq!(
        again
            .status(&ThreadId::new("t-none").expect("an id"))
            .await
            .expect("status"),
        tether_restate::ThreadStatus::default()
    );
}

/// A tail past the record's length (a turn killed after its write, before Restate stored the
/// length) is never shown, and the next turn writes over it.
#[tokio::test(flavor = "multi_thread")]
async fn a_tail_past_the_length_is_hidden_and_written_over() {
    let pg = Postgres::start().await;
    let record = SharedRecord::connect(&pg.connection()).await.expect("connect");
    record
        .write(Write::new(thread("t-k", 2_000), 3).events(vec![
            event(1, "e1", "one"),
            event(2, "e2", "two"),
            event(3, "killed", "never stored"),
        ]))
        .await
        .expect("the killed turn's write");
    // What Restate stored for the killed turn: two events. Its next turn writes from there.
    record
        .write(Write::new(thread("t-k", 3_000), 2))
        .await
        .expect("the length as stored");
    let shown = record.events_after("t-k", 0, 128).await.expect("events");
    assert_eq!(shown.len(), 2, "the tail is hidden: {shown:?}");
    record
        .write(Write::new(thread("t-k", 4_000), 3).events(vec![event(3, "e3", "three")]))
        .await
        .expect("the next turn");
    let shown = record.events_after("t-k", 0, 128).await.expect("events");
    let ids: Vec<&str> = shown.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["e1", "e2", "e3"], "written over");
}

/// A bad connection string is a typed configuration error, and an unreachable database a
/// store error that names it, not a panic.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_or_unreachable_database_is_a_clear_error() {
    let e = SharedRecord::connect("host=127.0.0.1 port=notaport")
        .await
        .expect_err("refused");
    assert!(matches!(e, tether::Error::Config { .. }), "{e:?}");
    let port = free_port();
    let e = SharedRecord::connect(&format!(
        "host=127.0.0.1 port={port} user=tether connect_timeout=2"
    ))
    .await
    .expect_err("nothing listens there");
    assert!(e.to_string().contains("PostgreSQL"), "{e}");
}

/// Turns on Restate keep their record in the database: the object state holds nothing of the
/// thread (Restate's own SQL over its state says so: no event, no thread, no checkpoint, each of
/// which would be a journal entry per turn), a front-end's store reads the same record, thread and
/// listing from the database as the thread object's handlers give, and the agent's index object
/// is never called.
#[tokio::test(flavor = "multi_thread")]
async fn a_turns_events_are_in_the_database_and_not_in_restates_state() {
    let restate = Restate::start().await;
    let pg = Postgres::start().await;
    let fake = FakeOpenAi::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: restate.admin.clone(),
        model_url: fake.url(),
        effects: dir.path().join("effects.log"),
        live: None,
        shared: Some(pg.connection()),
    };
    let service = Service::start(&config);
    fake.push(Reply::tool_calls(&[(
        "call_1",
        "append_line",
        r#"{"text":"one"}"#,
    )]))
    .push(Reply::text("Appended."));
    let (status, out) = call(
        &restate.ingress,
        "t-db",
        "turn",
        &json!({"message_id": "m1", "text": "append one"}),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(effects(&config.effects), vec!["append_line call_1 one"]);
    let length = out["length"].as_u64().expect("a length");
    assert!(length >= 4, "{out}");

    // Restate's state of the thread: none.
    let rows = reqwest::Client::new()
        .post(format!("{}/query", restate.admin))
        .header("accept", "application/json")
        .json(&json!({"query": "SELECT key FROM state WHERE service_name = 'TetherThread' AND service_key = 't-db'"}))
        .send()
        .await
        .expect("the admin query")
        .json::<serde_json::Value>()
        .await
        .expect("its rows");
    let keys: Vec<&str> = rows["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    assert!(
        keys.is_empty(),
        "the thread's state on Restate: {keys:?} ({rows})"
    );
    // The local loop's checkpoint is the database's.
    let checkpoint = SharedRecord::connect(&pg.connection())
        .await
        .expect("connect")
        .checkpoint("t-db")
        .await
        .expect("a read");
    assert!(
        checkpoint.is_some(),
        "the turn's checkpoint is not in the database"
    );
    let (_, index) = reqwest::Client::new()
        .post(format!("{}/query", restate.admin))
        .header("accept", "application/json")
        .json(&json!({"query": "SELECT count(*) AS n FROM state WHERE service_name = 'TetherThreads'"}))
        .send()
        .await
        .map(|r| ((), r))
        .expect("the admin query");
    let index = index.json::<serde_json::Value>().await.expect("its rows");
    assert_eq!(
        index["rows"][0]["n"],
        json!(0),
        "the index object was called: {index}"
    );

    // The front-end's store, from the database, and the thread object's own handlers agree.
    let from_db =
        store(&restate.ingress).with_shared(SharedRecord::connect(&pg.connection()).await.expect("connect"));
    let events = from_db.load("t-db").await.expect("the record");
    assert_eq!(events.len() as u64, length);
    let (status, paged) = call(
        &restate.ingress,
        "t-db",
        "events",
        &json!({"after": 0, "limit": 128}),
    )
    .await;
    assert_eq!(status, 200, "{paged}");
    assert_eq!(paged, serde_json::to_value(&events).expect("json"));
    let id = ThreadId::new("t-db").expect("an id");
    let t = from_db.thread(&id).await.expect("a read").expect("the thread");
    let (_, held) = call(&restate.ingress, "t-db", "thread", &json!(null)).await;
    assert_eq!(serde_json::to_value(&t).expect("json"), held);
    assert_eq!(from_db.threads(None).await.expect("listed"), vec![t]);
    let glance = from_db.status(&id).await.expect("status");
    assert_eq!(
        (
            glance.length,
            glance.invocation.as_deref(),
            glance.message.as_deref()
        ),
        (length, None, Some("m1"))
    );
    service.kill();
}

/// A turn starts where the record ends, unless it is the thread's running turn replayed: then
/// where it started the first time, from the thread and the checkpoint as it found them (its
/// journal must replay as it was written); a failed turn's marks are cleared only for that turn.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_turn_starts_where_it_first_did() {
    let pg = Postgres::start().await;
    let record = SharedRecord::connect(&pg.connection()).await.expect("connect");
    let id = ThreadId::new("t-r").expect("an id");
    let first = record.turn_start(&id, "inv-1").await.expect("start");
    assert_eq!(first, Start::default(), "nothing before a first turn");
    // The first turn (no thread in the database when it started) wrote two events and a
    // checkpoint.
    record
        .write(
            Write::new(thread("t-r", 2_000), 2)
                .events(vec![event(1, "e1", "one"), event(2, "e2", "two")])
                .checkpoint(Some(json!({"turns": 1})))
                .marks(Some("inv-1".into()), Some("m1".into()), None)
                .started(&first),
        )
        .await
        .expect("a write");
    assert_eq!(
        record.turn_start(&id, "inv-1").await.expect("a replay"),
        Start::default(),
        "a replay starts where the first attempt did, not from what it wrote"
    );
    let second = record.turn_start(&id, "inv-2").await.expect("the next turn");
    assert_eq!(
        (
            second.thread.as_ref().map(|t| t.updated_ms),
            second.length,
            second.checkpoint.clone()
        ),
        (Some(2_000), 2, Some(json!({"turns": 1})))
    );
    // The second turn moves the checkpoint on; its replay starts from the one it found.
    record
        .write(
            Write::new(thread("t-r", 3_000), 3)
                .events(vec![event(3, "e3", "three")])
                .checkpoint(Some(json!({"turns": 2})))
                .marks(Some("inv-2".into()), Some("m2".into()), None)
                .started(&second),
        )
        .await
        .expect("a write");
    assert_eq!(record.turn_start(&id, "inv-2").await.expect("a replay"), second);
    // It failed before its last write: only its own marks are cleared.
    assert!(!record.turn_over("t-r", "inv-1").await.expect("not that turn's"));
    assert!(record.turn_over("t-r", "inv-2").await.expect("its marks"));
    let status = record.status(&id).await.expect("status");
    assert_eq!((status.invocation, status.length), (None, 3), "the record stays");
    let next = record.turn_start(&id, "inv-2").await.expect("start");
    assert_eq!((next.length, next.checkpoint), (3, Some(json!({"turns": 2}))));
}

/// Ids an attacker picks reach the database only as parameters: a thread id made of SQL and
/// quotes, or of 256 bytes of multi-byte characters, is stored and read back as itself and
/// touches no other thread; one with control characters never gets that far (`ThreadId`).
#[tokio::test(flavor = "multi_thread")]
async fn hostile_ids_are_data_not_sql() {
    let pg = Postgres::start().await;
    let record = SharedRecord::connect(&pg.connection()).await.expect("connect");
    record
        .write(Write::new(thread("t-other", 1_000), 1).events(vec![event(1, "o1", "other")]))
        .await
        .expect("another thread");
    let long: String = "é".repeat(128);
    for id in [
        "x'); drop table tether_events; --",
        "a\\' or '1'='1",
        long.as_str(),
    ] {
        record
            .write(Write::new(thread(id, 2_000), 1).events(vec![event(1, "h1", "hostile")]))
            .await
            .expect("a hostile id is stored");
        let tid = ThreadId::new(id).expect("a valid id");
        let status = record.status(&tid).await.expect("status");
        assert_eq!(status.thread.map(|t| t.id), Some(tid.clone()), "{id}");
        assert_eq!(
            record.events_after(id, 0, 10).await.expect("events").len(),
            1,
            "{id}"
        );
    }
    let other = record
        .events_after("t-other", 0, 10)
        .await
        .expect("the other thread");
    assert_eq!(other.len(), 1, "the other thread is untouched");
    assert_eq!(record.threads(&["demo"]).await.expect("listed").len(), 4);
    assert!(
        ThreadId::new("t\u{0}\n").is_err(),
        "control characters never reach the database"
    );
    assert!(
        ThreadId::new("x".repeat(257)).is_err(),
        "nor ids longer than 256 bytes"
    );
}
