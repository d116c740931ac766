//! Provisioning agents and environments against the fake.

use serde_json::json;
use tether::ToolSpec;
use tether_anthropic::ClientConfig;
use tether_anthropic::provision::{AgentSpec, provision, teardown};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

fn spec() -> AgentSpec {
    AgentSpec::new("helper", "anthropic:claude-test")
        .with_system("You help.")
        .with_tools(vec![ToolSpec::new(
            "lookup",
            "Look up",
            json!({"type": "object"}),
        )])
        .with_builtin_tools(vec![json!({"type": "agent_toolset_20260401"})])
}

#[tokio::test]
async fn creates_then_adopts_on_409() {
    let fake = FakeManaged::start(vec![], ManagedFaults::default()).await;
    let cfg = ClientConfig::new("sk-test").base_url(fake.url());
    let first = provision(&cfg, &spec()).await.expect("provision");
    assert!(first.created_agent && first.created_environment);
    let agent = &fake.agents()[0];
    assert_eq!(agent["model"], "claude-test");
    assert_eq!(agent["tools"][1]["type"], "custom");
    assert_eq!(agent["tools"][1]["name"], "lookup");
    let again = provision(&cfg, &spec()).await.expect("adopt");
    assert!(!again.created_agent && !again.created_environment);
    assert_eq!(again.agent_id, first.agent_id);
    assert_eq!(fake.agents().len(), 1);
    teardown(&cfg, &first).await.expect("teardown");
    assert!(!fake.agents()[0]["archived_at"].is_null());
    assert!(!fake.environments()[0]["archived_at"].is_null());
}

#[tokio::test]
async fn a_failed_environment_rolls_the_new_agent_back() {
    let fake = FakeManaged::start(
        vec![],
        ManagedFaults {
            environment_status: Some(500),
            ..ManagedFaults::default()
        },
    )
    .await;
    let cfg = ClientConfig::new("sk-test").base_url(fake.url());
    let err = provision(&cfg, &spec()).await.expect_err("env fails");
    assert_eq!(err.status(), Some(500));
    let agents = fake.agents();
    assert_eq!(agents.len(), 1);
    assert!(
        !agents[0]["archived_at"].is_null(),
        "the agent created was archived"
    );
}
