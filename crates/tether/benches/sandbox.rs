//! What the sandbox costs a command: `run_command("true")` confined (Landlock + seccomp, the
//! default) and unconfined (`SandboxMode::Off`), interleaved call by call in one process so both
//! see the same machine load. Prints the median and mean per call of each, their difference and
//! ratio. Goal: confined costs at most 5 ms more per call.
//!
//! `cargo bench -p tether-core --bench sandbox [-- CALLS]` (default 300 calls of each).

use std::time::{Duration, Instant};

use serde_json::json;
use tether::sandbox::{Sandbox, SandboxMode, Support};
use tether::workspace::{Policy, Workspace};
use tether::{Handler, SessionInfo, ToolOutput, ToolUse};

async fn once(ws: &Workspace, info: &SessionInfo) -> Duration {
    let call = ToolUse::new("b", "run_command", json!({"command": "true"}));
    let t = Instant::now();
    let out = ws.call_tool(&call, info).await;
    let d = t.elapsed();
    assert!(matches!(out, ToolOutput::Ok(_)), "{out:?}");
    d
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let median = ms(v[v.len() / 2]);
    let mean = v.iter().map(|d| ms(*d)).sum::<f64>() / v.len() as f64;
    (median, mean)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let calls: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(300);
    let support = Support::current();
    assert!(
        support.confines(),
        "this kernel cannot confine: {}",
        support.describe()
    );
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let confined = Workspace::new(&dir)
        .unwrap()
        .policy(Policy::allow_all())
        .sandbox(Sandbox::new(SandboxMode::Require));
    let open = Workspace::new(&dir)
        .unwrap()
        .policy(Policy::allow_all())
        .sandbox(Sandbox::new(SandboxMode::Off));
    let info = SessionInfo::new("bench", "bench");
    for _ in 0..20 {
        once(&confined, &info).await;
        once(&open, &info).await;
    }
    let (mut c, mut o) = (Vec::new(), Vec::new());
    for i in 0..calls {
        // Alternate which goes first so neither always follows the other.
        if i % 2 == 0 {
            c.push(once(&confined, &info).await);
            o.push(once(&open, &info).await);
        } else {
            o.push(once(&open, &info).await);
            c.push(once(&confined, &info).await);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (cm, ca) = stats(c);
    let (om, oa) = stats(o);
    println!("sandbox: {} ({calls} calls of `true` each)", support.describe());
    println!("confined   median {cm:.3} ms  mean {ca:.3} ms");
    println!("unconfined median {om:.3} ms  mean {oa:.3} ms");
    println!(
        "difference median {:+.3} ms  mean {:+.3} ms; ratio (median) {:.2}x; goal: <= +5 ms",
        cm - om,
        ca - oa,
        cm / om
    );
}
