//! The agent's process: how it is shut down, killed and reaped, and how its exit is described.

use std::time::Duration;

use super::{Conn, lock};
use crate::error::AcpError;

impl Conn {
    /// Closes stdin, waits up to the grace period for the agent to exit, then kills it.
    pub(crate) async fn shutdown(&self) {
        self.close(
            AcpError::Closed {
                reason: "the client shut the connection down".into(),
            },
            false,
        );
        let child = lock(&self.child).take();
        if let Some(mut child) = child
            && tokio::time::timeout(self.opts.shutdown_grace, child.wait())
                .await
                .is_err()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Kills the agent without waiting (used on drop).
    pub(crate) fn kill_now(&self) {
        self.close(
            AcpError::Closed {
                reason: "the client was dropped".into(),
            },
            true,
        );
    }

    /// Reaps the agent after its stdout closed and describes how it exited.
    pub(super) async fn reap(&self) -> Option<String> {
        let child = lock(&self.child).take();
        let mut child = child?;
        let status = match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
            Ok(Ok(s)) => s,
            _ => {
                let _ = child.start_kill();
                return Some("still running after closing stdout; killed".into());
            }
        };
        Some(describe_exit(status))
    }
}

pub(super) fn describe_exit(status: std::process::ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    status.to_string()
}
