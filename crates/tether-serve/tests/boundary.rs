//! `tether serve`'s trust boundary (issue 11, item 1): Host and Origin checks on every route,
//! CORS for listed origins, a token by default. Requests a browser page could make are sent as
//! raw HTTP on real sockets (a normal client would not forge `Host`); the token default and
//! `--no-token` are driven through the real binary, which is how they are met.

mod common;

use std::process::Stdio;

use common::*;
use serde_json::json;
use tether_testkit::openai::Reply;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The rebinding attack of the issue: a page on `http://attacker.example:PORT` whose name now
/// resolves to 127.0.0.1 sends same-origin requests (Host and Origin both attacker.example). On
/// the old code a prompt leading to `read_file` returned the file; now every route refuses it.
#[tokio::test]
async fn a_rebinding_page_is_refused_on_every_route() {
    let env = Env::new().await;
    std::fs::create_dir_all(env.ws()).unwrap();
    std::fs::write(env.ws().join("secret.txt"), "the user's secret").unwrap();
    env.fake.push(Reply::tool_calls(&[(
        "call_r",
        "read_file",
        r#"{"path":"secret.txt"}"#,
    )]));
    env.fake.push(Reply::text("here it is"));
    // No token: the default setup the issue attacked (now `--no-token`).
    let server = env.start(env.config(""), None).await;
    let addr = server.addr();
    let port = addr.port();
    let evil = format!("attacker.example:{port}");
    let origin = format!("Origin: http://{evil}");
    let body = input("t", "r1", user("u1", "read secret.txt")).to_string();
    let r = raw(addr, &run_head("main", &evil, &origin), &body).await;
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(r.json()["code"], "HOST_NOT_ALLOWED", "{r:?}");
    assert!(!r.body.contains("secret"), "{r:?}");
    assert!(env.fake.requests().is_empty(), "the model was never called");
    for path in [
        "/",
        "/assets/app.js",
        "/healthz",
        "/v1/agents",
        "/v1/threads",
        "/v1/threads/t/events",
        "/v1/threads/t/messages",
    ] {
        let head = format!("GET {path} HTTP/1.1\r\nHost: {evil}\r\n{origin}");
        let r = raw(addr, &head, "").await;
        assert_eq!(r.status, 403, "{path}: {r:?}");
        assert_eq!(r.json()["code"], "HOST_NOT_ALLOWED", "{path}");
    }
    // Other names that are not this machine's loopback, and no Host at all.
    for host in [
        format!("localhost.attacker.example:{port}"),
        format!("127.0.0.1.nip.io:{port}"),
        format!("a.localhost:{port}"),
        format!("192.168.1.10:{port}"),
    ] {
        let r = raw(addr, &format!("GET /v1/agents HTTP/1.1\r\nHost: {host}"), "").await;
        assert_eq!(r.status, 403, "{host}: {r:?}");
    }
    let r = raw(addr, "GET /v1/agents HTTP/1.0", "").await;
    assert_eq!(r.status, 403, "no Host: {r:?}");
    // The loopback names work, on any port (a port forward, a proxy).
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LOCALHOST".to_owned(),
        "127.0.0.2:1".to_owned(),
        format!("[::1]:{port}"),
    ] {
        let r = raw(addr, &format!("GET /v1/agents HTTP/1.1\r\nHost: {host}"), "").await;
        assert_eq!(r.status, 200, "{host}: {r:?}");
    }
    let r = raw(
        addr,
        &run_head(
            "main",
            &format!("localhost:{port}"),
            &format!("Origin: http://localhost:{port}"),
        ),
        &body,
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("RUN_FINISHED"), "{r:?}");
}

/// A page of another origin (another port is another origin) is refused; an origin listed in
/// `[server] allowed_origins` gets CORS answers, its preflight included.
#[tokio::test]
async fn cross_origin_requests_are_refused_unless_the_origin_is_listed() {
    let env = Env::new().await;
    env.fake.push(Reply::text("hello from a listed origin"));
    let cfg = env.config_with(r#"allowed_origins = ["http://localhost:5173"]"#, "");
    let server = env.start(cfg, Some("tok")).await;
    let addr = server.addr();
    let host = addr.to_string();
    let auth = "Authorization: Bearer tok";
    let body = input("t", "r1", user("u1", "hi")).to_string();

    for origin in [
        "http://evil.example".to_owned(),
        format!("http://localhost:{}", addr.port()),
        format!("http://127.0.0.1:{}", addr.port() as u32 + 1),
        "null".to_owned(),
        "http://localhost:5173.evil.example".to_owned(),
    ] {
        // Even with the token (which a page cannot have): refused for its origin.
        let o = format!("Origin: {origin}\r\n{auth}");
        let r = raw(addr, &run_head("main", &host, &o), &body).await;
        assert_eq!(r.status, 403, "{origin}: {r:?}");
        assert_eq!(r.json()["code"], "ORIGIN_NOT_ALLOWED", "{origin}");
        assert!(r.header("access-control-allow-origin").is_none());
        let r = raw(
            addr,
            &format!("GET /v1/threads HTTP/1.1\r\nHost: {host}\r\n{o}"),
            "",
        )
        .await;
        assert_eq!(r.status, 403, "{origin}: {r:?}");
        let pre = format!(
            "OPTIONS /v1/agents/main/run HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\n\
             Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type"
        );
        let r = raw(addr, &pre, "").await;
        assert_eq!(r.status, 403, "preflight from {origin}: {r:?}");
    }
    assert!(env.fake.requests().is_empty());

    // A subresource another site's page made carries no Origin; Sec-Fetch-Site gives it away.
    let r = raw(
        addr,
        &format!(
            "GET /v1/threads HTTP/1.1\r\nHost: {host}\r\n{auth}\r\nSec-Fetch-Site: cross-site\r\nSec-Fetch-Mode: no-cors\r\nSec-Fetch-Dest: script"
        ),
        "",
    )
    .await;
    assert_eq!(r.status, 403, "{r:?}");
    // A link the user follows to the UI is a navigation: served.
    let r = raw(
        addr,
        &format!(
            "GET / HTTP/1.1\r\nHost: {host}\r\nSec-Fetch-Site: cross-site\r\nSec-Fetch-Mode: navigate\r\nSec-Fetch-Dest: document"
        ),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-frame-options"), Some("DENY"));
    assert!(
        r.header("content-security-policy")
            .unwrap()
            .contains("frame-ancestors 'none'")
    );
    // The server's own origin needs no CORS.
    let own = format!("Origin: http://{host}\r\n{auth}");
    let r = raw(
        addr,
        &format!("GET /v1/agents HTTP/1.1\r\nHost: {host}\r\n{own}"),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.header("access-control-allow-origin").is_none());

    // The listed origin: preflight, then the call, with the CORS headers a browser needs.
    let listed = "http://localhost:5173";
    let pre = format!(
        "OPTIONS /v1/agents/main/run HTTP/1.1\r\nHost: {host}\r\nOrigin: {listed}\r\n\
         Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\
         Access-Control-Request-Private-Network: true"
    );
    let r = raw(addr, &pre, "").await;
    assert_eq!(r.status, 204, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some(listed));
    let allowed_headers = r
        .header("access-control-allow-headers")
        .unwrap()
        .to_ascii_lowercase();
    assert!(allowed_headers.contains("authorization") && allowed_headers.contains("content-type"));
    assert!(r.header("access-control-allow-methods").unwrap().contains("POST"));
    assert!(r.header("vary").unwrap().contains("Origin"));
    assert_eq!(r.header("access-control-allow-private-network"), Some("true"));
    let o = format!("Origin: {listed}\r\n{auth}");
    let r = raw(addr, &run_head("main", &host, &o), &body).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some(listed));
    assert!(r.header("vary").unwrap().contains("Origin"));
    assert!(r.body.contains("hello from a listed origin"), "{r:?}");
    // A wrong token from the listed origin: a 401 the page can read.
    let r = raw(
        addr,
        &format!(
            "GET /v1/threads HTTP/1.1\r\nHost: {host}\r\nOrigin: {listed}\r\nAuthorization: Bearer nope"
        ),
        "",
    )
    .await;
    assert_eq!(r.status, 401, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some(listed));
}

/// Starts the real binary and returns it with the lines it printed up to its "open" line.
async fn spawn_serve(
    args: &[&str],
    envs: &[(&str, &str)],
    cwd: &std::path::Path,
) -> (
    tokio::process::Child,
    Vec<String>,
    tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-serve"));
    cmd.args(args)
        .env_remove("TETHER_TOKEN")
        .env_remove("TETHER_MODEL")
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    tokio::time::timeout(PATIENCE, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            let done = l.contains("tether serve: open ");
            seen.push(l);
            if done {
                return;
            }
        }
        panic!("tether-serve ended before it was ready: {seen:?}");
    })
    .await
    .expect("tether-serve starts");
    (child, seen, lines)
}

fn base_of(lines: &[String]) -> String {
    let l = lines.iter().find(|l| l.contains("listening on http://")).unwrap();
    let url = l.split("listening on ").nth(1).unwrap();
    url.split_whitespace().next().unwrap().to_owned()
}

async fn sigterm_and_collect(
    mut child: tokio::process::Child,
    mut lines: tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    seen: &mut Vec<String>,
) {
    let pid = child.id().unwrap().to_string();
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(st.success());
    tokio::time::timeout(PATIENCE, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            seen.push(l);
        }
        child.wait().await.unwrap()
    })
    .await
    .expect("tether-serve stops on SIGTERM");
}

/// With no `--token`, the binary generates one, prints the UI's URL carrying it once (in the
/// fragment), and every `/v1/` route requires it.
#[tokio::test]
async fn the_binary_generates_a_token_prints_it_once_and_requires_it() {
    let env = Env::new().await;
    env.fake.push(Reply::text("authorised"));
    let cfg = env.dir.path().join("tether.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agents.main]\nbase_url = \"{}\"\nmodel = \"fake\"\n",
            env.fake.url()
        ),
    )
    .unwrap();
    let db = env.dir.path().join("t.db");
    let (child, mut seen, lines) = spawn_serve(
        &[
            "--bind",
            "127.0.0.1:0",
            "--config",
            cfg.to_str().unwrap(),
            "--db",
            db.to_str().unwrap(),
        ],
        &[],
        env.dir.path(),
    )
    .await;
    let base = base_of(&seen);
    let open = seen
        .iter()
        .find(|l| l.contains("tether serve: open "))
        .unwrap()
        .clone();
    let url = open.split("open ").nth(1).unwrap();
    let token = url
        .strip_prefix(&format!("{base}/#token="))
        .unwrap_or_else(|| panic!("the URL carries the token in its fragment: {open}"));
    assert_eq!(token.len(), 48, "192 bits in hex: {token}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));

    let c = client();
    let r = c.get(format!("{base}/v1/agents")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(format!("{base}/v1/agents"))
        .bearer_auth("0".repeat(48))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(format!("{base}/v1/agents"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        c.get(format!("{base}/")).send().await.unwrap().status(),
        200,
        "the UI page is public"
    );
    let body = input("t", "r1", user("u1", "hi"));
    let r = c
        .post(format!("{base}/v1/agents/main/run"))
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no run without the token");
    let r = c
        .post(format!("{base}/v1/agents/main/run"))
        .bearer_auth(token)
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(text_of(&sse_events(&r.text().await.unwrap())), "authorised");

    let token = token.to_owned();
    sigterm_and_collect(child, lines, &mut seen).await;
    let all = seen.join("\n");
    assert_eq!(all.matches(&token).count(), 1, "printed exactly once: {all}");

    // A second start generates another token.
    let db2 = env.dir.path().join("t2.db");
    let (child, seen2, lines) = spawn_serve(
        &[
            "--bind",
            "127.0.0.1:0",
            "--config",
            cfg.to_str().unwrap(),
            "--db",
            db2.to_str().unwrap(),
        ],
        &[],
        env.dir.path(),
    )
    .await;
    assert!(!seen2.join("\n").contains(&token));
    sigterm_and_collect(child, lines, &mut Vec::new()).await;
}

/// `--no-token` is allowed on loopback only; with a token given as well it is refused.
#[tokio::test]
async fn no_token_works_on_loopback_and_is_refused_elsewhere() {
    let env = Env::new().await;
    let cfg = env.dir.path().join("tether.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agents.main]\nbase_url = \"{}\"\nmodel = \"fake\"\n",
            env.fake.url()
        ),
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let db = env.dir.path().join("t.db");
    let db = db.to_str().unwrap();
    let (child, mut seen, lines) = spawn_serve(
        &["--no-token", "--bind", "127.0.0.1:0", "--config", cfg, "--db", db],
        &[],
        env.dir.path(),
    )
    .await;
    let base = base_of(&seen);
    assert!(seen.iter().any(|l| l.contains("--no-token")), "{seen:?}");
    assert!(!seen.join("\n").contains("#token="));
    let r = client().get(format!("{base}/v1/agents")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    sigterm_and_collect(child, lines, &mut seen).await;

    for (args, envs, expect) in [
        (
            vec!["--no-token", "--bind", "0.0.0.0:0"],
            vec![],
            "without a token",
        ),
        (
            vec!["--no-token", "--token", "x", "--bind", "127.0.0.1:0"],
            vec![],
            "both given",
        ),
        (
            vec!["--no-token", "--bind", "127.0.0.1:0"],
            vec![("TETHER_TOKEN", "x")],
            "both given",
        ),
    ] {
        let dbx = env.dir.path().join("refused.db");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tether-serve"))
            .args(&args)
            .args(["--config", cfg, "--db"])
            .arg(&dbx)
            .env_remove("TETHER_TOKEN")
            .envs(envs)
            .current_dir(env.dir.path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expect), "{args:?}: {err}");
        assert!(!dbx.exists(), "nothing was created");
    }
}

/// Issue 11, item 10: without `TETHER_MODEL` every run failed with "no model name". It now uses
/// `tether run`'s default, `default`, with the default configuration (no --config).
#[tokio::test]
async fn serve_without_tether_model_uses_the_default_model() {
    let env = Env::new().await;
    env.fake.push(Reply::text("answered by the default model"));
    let db = env.dir.path().join("t.db");
    let url = env.fake.url();
    let (child, mut seen, lines) = spawn_serve(
        &[
            "--no-token",
            "--bind",
            "127.0.0.1:0",
            "--db",
            db.to_str().unwrap(),
        ],
        &[("OPENAI_BASE_URL", url.as_str())],
        env.dir.path(),
    )
    .await;
    let base = base_of(&seen);
    let r = client()
        .post(format!("{base}/v1/agents/default/run"))
        .header("accept", "text/event-stream")
        .json(&input("t", "r1", user("u1", "hi")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ev = sse_events(&r.text().await.unwrap());
    assert_eq!(last(&ev)["type"], "RUN_FINISHED", "{ev:?}");
    assert_eq!(text_of(&ev), "answered by the default model");
    assert_eq!(env.fake.requests()[0].body["model"], json!("default"));
    let (_, agents) = (
        200,
        client()
            .get(format!("{base}/v1/agents"))
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap(),
    );
    assert_eq!(agents["agents"][0]["model"], "default");
    sigterm_and_collect(child, lines, &mut seen).await;
}
