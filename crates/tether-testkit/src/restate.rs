//! A real Restate server on loopback for the tests of `tether-restate` and of `tether serve`'s
//! Restate backend: the pinned `restate-server` from npm (`conformance/restate`, installed by its
//! `setup.sh`, which `scripts/test` runs), one node or a cluster, each node in a temp dir of its
//! own. A missing server fails the test with how to install it, never a silent pass.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a node may take to become healthy on a busy machine.
pub const STARTUP: Duration = Duration::from_secs(120);

/// `conformance/restate`, where the pinned server and its base configuration are.
pub fn conformance_dir() -> PathBuf {
    crate::peers::repo_root().join("conformance/restate")
}

/// The pinned `restate-server` launcher.
///
/// # Panics
/// When it is not installed, saying how to install it.
pub fn server_bin() -> PathBuf {
    let bin = conformance_dir().join("node_modules/.bin/restate-server");
    assert!(
        bin.exists(),
        "the Restate server is not installed at {}: run conformance/restate/setup.sh (scripts/test does)",
        bin.display()
    );
    bin
}

/// A free port on 127.0.0.1 for a process that will listen on it later (a Restate node, a
/// tether node's service endpoint).
///
/// Chosen below Linux's ephemeral range (32768–60999 by default), and checked free by binding
/// it: a port the kernel hands out for `:0` is also one it hands to outgoing connections, and a
/// busy test (nodes of a cluster connecting to each other) took such a port between its release
/// and the node's bind ("Address in use"). Ports step from a start derived from the process id,
/// so test processes running at once rarely try the same ones; `:0` is the fallback.
///
/// # Panics
/// When no port can be bound.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 12_000;
    const SPAN: u32 = 20_000; // 12000..32000, below the ephemeral range
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..256 {
        let step = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = LOW + (start + step.wrapping_mul(17)) % SPAN;
        if let Ok(port) = u16::try_from(port)
            && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
        {
            return port;
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// One `restate-server` node; its whole process group is SIGKILLed when dropped.
pub struct Restate {
    child: Child,
    /// The admin API's base URL (`http://127.0.0.1:<port>`).
    pub admin: String,
    /// The ingress's base URL (`http://127.0.0.1:<port>`).
    pub ingress: String,
    dir: tempfile::TempDir,
}

impl Restate {
    /// A single-node server, healthy.
    ///
    /// # Panics
    /// When the server is missing or does not become healthy within [`STARTUP`] (with its log).
    pub async fn start() -> Restate {
        Restate::start_node("n1", free_port(), None).await
    }

    /// A cluster of `n` nodes on loopback, replication 2 (logs and partitions), the first node
    /// provisioning it; returns once every node is healthy.
    ///
    /// # Panics
    /// As [`Restate::start`].
    pub async fn start_cluster(n: usize) -> Vec<Restate> {
        let fabrics: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let addresses: Vec<String> = fabrics
            .iter()
            .map(|p| format!("\"http://127.0.0.1:{p}\""))
            .collect();
        let tables = format!(
            "\n[metadata-client]\naddresses = [{}]\n\n[bifrost]\ndefault-provider = \"replicated\"\n",
            addresses.join(", ")
        );
        let starts = fabrics.iter().enumerate().map(|(i, &fabric)| {
            let top = format!(
                "cluster-name = \"tether-test\"\ndefault-replication = 2\nauto-provision = {}\n",
                i == 0
            );
            let tables = tables.clone();
            async move { Restate::start_node(&format!("n{}", i + 1), fabric, Some((top, tables))).await }
        });
        futures_util::future::join_all(starts).await
    }

    /// One node: `cluster` is (top-level keys, tables) added to `conformance/restate/restate.toml`.
    async fn start_node(name: &str, fabric: u16, cluster: Option<(String, String)>) -> Restate {
        let bin = server_bin();
        let dir = tempfile::tempdir().expect("tempdir");
        let (admin, ingress) = (free_port(), free_port());
        let base = std::fs::read_to_string(conformance_dir().join("restate.toml")).expect("restate.toml");
        let (top, tables) = cluster.unwrap_or_default();
        // Top-level keys before the base file's tables, tables after.
        let config = dir.path().join("restate.toml");
        std::fs::write(&config, format!("{top}\n{base}\n{tables}")).expect("write config");
        let log = std::fs::File::create(dir.path().join("restate.log")).expect("log file");
        // Its own process group: `node_modules/.bin/restate-server` is a launcher that starts the
        // server as its child, and killing the launcher alone leaves the server running.
        let child = Command::new(bin)
            .process_group(0)
            .arg("--no-logo")
            .args(["--listen-mode", "tcp"])
            .arg("--config-file")
            .arg(&config)
            .arg("--base-dir")
            .arg(dir.path())
            .args(["--node-name", name])
            .env("RESTATE_ADMIN__BIND_ADDRESS", format!("127.0.0.1:{admin}"))
            .env("RESTATE_INGRESS__BIND_ADDRESS", format!("127.0.0.1:{ingress}"))
            .env("RESTATE_BIND_ADDRESS", format!("127.0.0.1:{fabric}"))
            .env("RESTATE_ADVERTISED_ADDRESS", format!("http://127.0.0.1:{fabric}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn restate-server");
        let r = Restate {
            child,
            admin: format!("http://127.0.0.1:{admin}"),
            ingress: format!("http://127.0.0.1:{ingress}"),
            dir,
        };
        let started = Instant::now();
        loop {
            if healthy(admin, "/health").await && healthy(ingress, "/restate/health").await {
                break;
            }
            assert!(
                started.elapsed() < STARTUP,
                "the Restate server {name} did not become healthy within {STARTUP:?}: {}",
                r.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        r
    }

    /// The `[server]` lines of a `tether.toml` that put an agent's turns on this node (the
    /// service endpoint on a port of its own).
    pub fn server_lines(&self) -> String {
        format!(
            "backend = \"restate\"\nrestate_ingress = \"{}\"\nrestate_admin = \"{}\"\nrestate_listen = \"127.0.0.1:0\"\n",
            self.ingress, self.admin
        )
    }

    /// SIGKILLs the node (its whole process group) and waits for the launcher.
    pub fn kill(mut self) {
        self.kill_group();
        let _ = self.child.wait();
    }

    fn kill_group(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on the process group this test started; no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
    }

    /// The node's log so far (for a failing assertion's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("restate.log")).unwrap_or_default()
    }
}

impl Drop for Restate {
    fn drop(&mut self) {
        self.kill_group();
        let _ = self.child.wait();
    }
}

/// Whether `GET path` on 127.0.0.1:`port` answers 2xx (plain HTTP/1.1, so the testkit needs no
/// HTTP client).
async fn healthy(port: u16, path: &str) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut head)).await;
    matches!(read, Ok(Ok(_))) && head.starts_with(b"HTTP/1.1 2")
}

/// A TCP forwarder on 127.0.0.1: each connection goes to the first of its targets that accepts
/// one, bytes copied both ways. Put in front of several tether service endpoints and registered
/// with Restate as one deployment (`restate_advertise`), Restate reaches the first live one:
/// when the first target dies, its connections break and new ones go to the next. In front of
/// the ingresses of a cluster's nodes, a client reaches the first live node.
///
/// Dropping it closes its listener and every connection it holds (a test that stops forwarding
/// leaves no connection copying in the background).
pub struct Forwarder {
    /// The forwarder's address.
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Listens on a free port and forwards to `targets`, in order of preference.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start(targets: Vec<std::net::SocketAddr>) -> Forwarder {
        Forwarder::listen(targets, None).await
    }

    /// As [`Forwarder::start`], in front of tether's service endpoints (HTTP/2 from Restate),
    /// with one stream's answer held back: once a DATA frame a target sends holds `marker`, that
    /// frame and every later DATA frame of its stream reach Restate `lag` late, while every
    /// other frame (other invocations, the connection's own) goes at once. Restate then hears
    /// the end of the turn that wrote `marker` (say, the model's last text) `lag` after the
    /// turn's node knew it, and answers the reads of the record meanwhile: the window in which
    /// a relay must not take its own process's word for what Restate holds, made wide and
    /// certain.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start_holding(
        targets: Vec<std::net::SocketAddr>,
        marker: &[u8],
        lag: Duration,
    ) -> Forwarder {
        Forwarder::listen(
            targets,
            Some(Hold {
                marker: marker.to_vec(),
                lag,
            }),
        )
        .await
    }

    async fn listen(targets: Vec<std::net::SocketAddr>, hold: Option<Hold>) -> Forwarder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the forwarder");
        let addr = listener.local_addr().expect("local addr");
        let targets = std::sync::Arc::new(targets);
        let task = tokio::spawn(async move {
            // The connections' tasks: aborted with this one when the forwarder is dropped.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    // Reap finished connections, so the set does not grow with every one.
                    Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                };
                let Ok((mut inbound, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let targets = targets.clone();
                let hold = hold.clone();
                connections.spawn(async move {
                    let _ = inbound.set_nodelay(true);
                    for t in targets.iter() {
                        if let Ok(mut outbound) = tokio::net::TcpStream::connect(t).await {
                            let _ = outbound.set_nodelay(true);
                            match hold {
                                None => {
                                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                                }
                                Some(h) => holding_copy(inbound, outbound, h).await,
                            }
                            return;
                        }
                    }
                    // No target alive: the connection is dropped, and Restate retries.
                });
            }
        });
        Forwarder { addr, task }
    }

    /// The forwarder's URL (`http://127.0.0.1:<port>`), to advertise to Restate.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// What [`Forwarder::start_holding`] holds back, and how long.
#[derive(Clone)]
struct Hold {
    marker: Vec<u8>,
    lag: Duration,
}

/// Copies bytes both ways between `client` (Restate) and `target` (a service endpoint) until
/// either side closes; the target's HTTP/2 frames are passed on whole, the DATA frames of a
/// stream that sent `hold.marker` (from that frame on) `hold.lag` late. Only DATA frames are
/// held: frames of other streams may overtake them (HTTP/2 orders frames within a stream
/// only), while HEADERS frames, whose header compression state is shared by the connection,
/// never are.
async fn holding_copy(client: tokio::net::TcpStream, target: tokio::net::TcpStream, hold: Hold) {
    use std::collections::{BTreeMap, HashMap};
    let (mut client_read, mut client_write) = client.into_split();
    let (mut target_read, mut target_write) = target.into_split();
    // Frames to pass on, each with when (the order of a stream's frames is kept: a frame
    // never goes before one sent earlier, as `when` only grows within a stream).
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let back = async move {
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = vec![0u8; 16 * 1024];
        // The streams held, and when their last frame goes.
        let mut held: HashMap<u32, tokio::time::Instant> = HashMap::new();
        loop {
            let n = match target_read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            // Every whole frame: a 9-byte header (24-bit length, type, flags, 31-bit stream).
            while buf.len() >= 9 {
                let len = usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
                if buf.len() < 9 + len {
                    break;
                }
                let frame: Vec<u8> = buf.drain(..9 + len).collect();
                let kind = frame[3];
                let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
                let now = tokio::time::Instant::now();
                let when = if kind == 0 {
                    let holds = held.contains_key(&stream)
                        || frame[9..]
                            .windows(hold.marker.len().max(1))
                            .any(|w| w == hold.marker.as_slice());
                    if holds {
                        let at = held
                            .get(&stream)
                            .map_or(now + hold.lag, |&t| t.max(now + hold.lag));
                        held.insert(stream, at);
                        at
                    } else {
                        now
                    }
                } else {
                    now
                };
                if tx.send((when, frame)).is_err() {
                    return;
                }
            }
        }
    };
    let deliver = async move {
        // Frames waiting for their time, in the order they go (by time, then as read).
        let mut queue: BTreeMap<(tokio::time::Instant, u64), Vec<u8>> = BTreeMap::new();
        let mut next = 0u64;
        let mut open = true;
        while open || !queue.is_empty() {
            let first = queue.keys().next().map(|k| k.0);
            tokio::select! {
                got = rx.recv(), if open => match got {
                    Some((when, frame)) => {
                        queue.insert((when, next), frame);
                        next += 1;
                    }
                    None => open = false,
                },
                _ = tokio::time::sleep_until(first.unwrap_or_else(tokio::time::Instant::now)), if first.is_some() => {
                    let now = tokio::time::Instant::now();
                    while let Some(entry) = queue.first_entry() {
                        if entry.key().0 > now {
                            break;
                        }
                        let frame = entry.remove();
                        if client_write.write_all(&frame).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
        let _ = client_write.shutdown().await;
    };
    let forth = async move {
        let _ = tokio::io::copy(&mut client_read, &mut target_write).await;
        let _ = target_write.shutdown().await;
    };
    tokio::join!(back, deliver, forth);
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}
