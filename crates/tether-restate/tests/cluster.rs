//! A 3-node Restate cluster on loopback (replication 2) keeps a thread's turn through the loss
//! of a node: the real restate-server from npm, the real service process.

mod common;

use common::*;
use serde_json::json;
use tether_testkit::openai::{FakeOpenAi, Reply};

/// A turn started through node 1 runs a tool, then waits for approval; node 1 is SIGKILLed; the
/// approval sent through node 2 resumes the turn, its result is read through node 3, and each
/// tool ran once.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_survives_the_loss_of_a_restate_node() {
    let mut nodes = Restate::start_cluster(3).await;
    let fake = FakeOpenAi::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: nodes[0].admin.clone(),
        model_url: fake.url(),
        effects: dir.path().join("effects.log"),
        live: None,
        shared: None,
    };
    let _service = Service::start(&config);
    fake.push(Reply::tool_calls(&[(
        "call_a",
        "append_line",
        r#"{"text":"first"}"#,
    )]))
    .push(Reply::tool_calls(&[(
        "call_g",
        "guarded_append",
        r#"{"text":"second"}"#,
    )]))
    .push(Reply::text("Both done."));
    let (first, second, third) = (
        nodes[0].ingress.clone(),
        nodes[1].ingress.clone(),
        nodes[2].ingress.clone(),
    );
    let body = json!({"message_id": "m1", "text": "append two lines"});
    let inv = send_turn(&first, "t-cluster", &body).await;
    until(
        "the turn to wait for approval (seen through node 2)",
        async || {
            let (status, v) = call(&second, "t-cluster", "waiting", &json!(null)).await;
            (status == 200 && v.as_array().is_some_and(|a| !a.is_empty())).then_some(())
        },
    )
    .await;
    assert_eq!(effects(&config.effects), vec!["append_line call_a first"]);

    nodes.remove(0).kill();

    // Node 2 may refuse while the cluster moves the partition's leadership: try until it takes it.
    until("node 2 to take the approval", async || {
        let (status, _) = call(
            &second,
            "t-cluster",
            "approve",
            &json!({"decision": "answer", "tool_use_id": "call_g", "approved": true}),
        )
        .await;
        (status == 200).then_some(())
    })
    .await;
    let out = until("the turn's result through node 3", async || {
        let (status, out) = attach(&third, &inv).await;
        (status == 200).then_some(out)
    })
    .await;
    assert_eq!(out["text"], "Both done.", "{out}");
    assert_eq!(
        effects(&config.effects),
        vec!["append_line call_a first", "guarded_append call_g second"]
    );
    assert_eq!(fake.requests().len(), 3, "no model call ran twice");
}
