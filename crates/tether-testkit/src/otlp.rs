//! An OTLP/HTTP receiver on loopback for benchmarks of traced runs: it reads each export (head
//! and `content-length` body, keep-alive), counts it and answers `200` with an empty body,
//! decoding nothing, so the exporter's cost is measured and the receiver's is as small as can be.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let sink = tether_testkit::otlp::OtlpSink::start().await;
//! assert!(sink.url().starts_with("http://127.0.0.1:"));
//! assert_eq!(sink.exports(), 0);
//! // Point OTEL_EXPORTER_OTLP_ENDPOINT (or the exporter's builder) at sink.url().
//! # }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running receiver; it serves until the runtime that started it stops.
#[derive(Debug, Clone)]
pub struct OtlpSink {
    url: String,
    counts: Arc<[AtomicU64; 2]>,
}

impl OtlpSink {
    /// Binds 127.0.0.1 on a free port and serves every connection on its own task.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub async fn start() -> OtlpSink {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1");
        let url = format!("http://{}", l.local_addr().expect("local addr"));
        let counts: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let c = counts.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve(s, c.clone()));
            }
        });
        OtlpSink { url, counts }
    }

    /// The base URL (`http://127.0.0.1:PORT`), without a path.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// How many exports (requests) were received.
    pub fn exports(&self) -> u64 {
        self.counts[0].load(Ordering::Relaxed)
    }

    /// How many body bytes the exports carried in all.
    pub fn bytes(&self) -> u64 {
        self.counts[1].load(Ordering::Relaxed)
    }
}

async fn serve(mut s: tokio::net::TcpStream, counts: Arc<[AtomicU64; 2]>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    loop {
        // One request: its head, then content-length bytes of body.
        let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") else {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + len {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + 4 + len);
        counts[0].fetch_add(1, Ordering::Relaxed);
        counts[1].fetch_add(len as u64, Ordering::Relaxed);
        let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if s.write_all(ok).await.is_err() {
            return;
        }
    }
}
