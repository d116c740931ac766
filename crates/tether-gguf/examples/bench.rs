//! The embedded model against llama.cpp, in one run, on the same GGUF, prompt length and thread
//! count (a benchmark, not a test):
//!
//! ```sh
//! crates/tether-gguf/scripts/reference.sh            # builds llama-bench once (and the goldens)
//! cargo run --release -p tether-gguf --example bench [-- MODEL.gguf]
//! ```
//!
//! Environment: `THREADS` (default: the machine's cores; also given to candle as
//! `CANDLE_NUM_THREADS` and to llama-bench as `-t`), `PP` prompt tokens (default 128), `TG`
//! decode tokens (default 64), `REPS` rounds (default 3), `CONVERSATION=0` to skip the conversation, `LLAMA_BENCH` (default: the one
//! `scripts/reference.sh` built).
//!
//! Method: REPS rounds, each one llama-bench run (`-p PP -n TG -r 1 -o json`: pre-fill and decode
//! tokens/s) then one of ours (pre-filling PP tokens of fixed text on a fresh cache, then TG
//! greedy decode steps), alternating so both see the same load; each round's ratios are printed
//! and the table gives the best of each side. llama.cpp's peak resident memory comes from
//! `/usr/bin/time -f %M` on one more run; our CPU time per token from `/proc/self/stat`; peak resident memory is `VmHWM` of this process after those runs (the model loaded,
//! one cache grown to PP+TG). Then a conversation of about 2,000 tokens (turns of fixed text)
//! is answered once (first turn: the whole prompt pre-filled) and a follow-up message is sent
//! (only the new tokens pre-filled): time to first token of each, from the model's counters.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::AtomicBool;

use serde_json::Value;
use tether::{ChatMessage, ChatRequest};
use tether_gguf::{GgufModel, Sampling};

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time (user + system) of this process so far, every thread, from `/proc/self/stat`:
/// robust against other processes sharing the cores, unlike wall time.
fn cpu_secs() -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let u: f64 = f.get(11)?.parse().ok()?;
            let k: f64 = f.get(12)?.parse().ok()?;
            Some((u + k) / tick)
        })
        .unwrap_or(0.0)
}

fn llama_bench(
    exe: &std::path::Path,
    model: &std::path::Path,
    threads: usize,
    pp: usize,
    tg: usize,
    reps: usize,
) -> Option<(f64, f64)> {
    let out = Command::new(exe)
        .args(["-m", &model.display().to_string(), "-t", &threads.to_string()])
        .args([
            "-p",
            &pp.to_string(),
            "-n",
            &tg.to_string(),
            "-r",
            &reps.to_string(),
            "-o",
            "json",
        ])
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    let mut pp_ts = 0.0;
    let mut tg_ts = 0.0;
    for r in v.as_array()? {
        let ts = r["avg_ts"].as_f64().unwrap_or(0.0);
        if r["n_prompt"].as_u64().unwrap_or(0) > 0 {
            pp_ts = ts;
        } else {
            tg_ts = ts;
        }
    }
    Some((pp_ts, tg_ts))
}

fn llama_rss(exe: &std::path::Path, model: &std::path::Path, threads: usize, pp: usize, tg: usize) -> u64 {
    Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(exe)
        .args(["-m", &model.display().to_string(), "-t", &threads.to_string()])
        .args(["-p", &pp.to_string(), "-n", &tg.to_string(), "-r", "1"])
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .and_then(|l| l.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let model_path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| tether_gguf::fetch::default_model().expect("the default model"));
    let threads = env_usize(
        "THREADS",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    );
    let (pp, tg, reps) = (env_usize("PP", 128), env_usize("TG", 64), env_usize("REPS", 3));
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: set before any thread of this process exists (candle reads it on first use).
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", threads.to_string()) };
    }
    let size = std::fs::metadata(&model_path).map(|m| m.len()).unwrap_or(0);
    println!(
        "model {} ({} MB), {threads} threads, pp {pp}, tg {tg}",
        model_path.display(),
        size / 1_000_000
    );

    let llama = std::env::var_os("LLAMA_BENCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache/tether/llama.cpp-11434.0.0/build/bin/llama-bench")
        });
    if !llama.exists() {
        println!(
            "(no llama-bench at {}: run scripts/reference.sh or set LLAMA_BENCH)",
            llama.display()
        );
    }

    let model = GgufModel::builder(&model_path)
        .threads(threads)
        .context(4096)
        .sampling(Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: Some(0),
        })
        .max_tokens(1)
        .build()
        .expect("model");
    let text = include_str!("../tests/data/ppl.txt");
    let tokens = model.tokenizer().encode(text, false).expect("tokens");
    let prompt = &tokens[..pp.min(tokens.len())];
    // Rounds alternate llama.cpp (one `llama-bench -r 1` run: pre-fill, then decode) and ours
    // (pre-fill on a fresh cache, then decode), so both see the same load; each round's ratio
    // is printed, and the best of each side.
    let (mut best_pp, mut best_tg) = (0f64, 0f64);
    let (mut ref_pp, mut ref_tg) = (0f64, 0f64);
    let mut cpu = 0f64;
    let mut wall = 0f64;
    for round in 0..reps.max(1) {
        let r = if llama.exists() {
            llama_bench(&llama, &model_path, threads, pp, tg, 1)
        } else {
            None
        };
        let c0 = cpu_secs();
        let (p, d) = model.bench_tokens(prompt, tg).expect("bench");
        cpu += cpu_secs() - c0;
        wall += (p + d).as_secs_f64();
        let (opp, otg) = (prompt.len() as f64 / p.as_secs_f64(), tg as f64 / d.as_secs_f64());
        best_pp = best_pp.max(opp);
        best_tg = best_tg.max(otg);
        if let Some((lpp, ltg)) = r {
            ref_pp = ref_pp.max(lpp);
            ref_tg = ref_tg.max(ltg);
            println!(
                "round {round}: pre-fill {opp:.1} vs {lpp:.1} tok/s ({:.2}×), decode {otg:.1} vs {ltg:.1} tok/s ({:.2}×)",
                opp / lpp,
                otg / ltg
            );
        } else {
            println!("round {round}: pre-fill {opp:.1} tok/s, decode {otg:.1} tok/s");
        }
    }
    let per_tok = (prompt.len() + tg) * reps.max(1);
    let reference = (ref_pp > 0.0).then(|| (ref_pp, ref_tg, llama_rss(&llama, &model_path, threads, pp, tg)));
    let rss = vm_hwm_kib();

    if std::env::var("CONVERSATION").is_ok_and(|v| v == "0") {
        println!(
            "| our CPU time per token (pre-fill + decode, all threads) | | {:.2} ms | | |",
            1000.0 * cpu / per_tok as f64
        );
        println!(
            "| pre-fill tok/s, decode tok/s (best) | {ref_pp:.1}, {ref_tg:.1} | {best_pp:.1}, {best_tg:.1} | {:.2}×, {:.2}× | |",
            best_pp / ref_pp,
            best_tg / ref_tg
        );
        return;
    }
    // A ~2,000-token conversation: the first turn pre-fills it all, the follow-up only the tail.
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut messages = vec![ChatMessage::system("You are a helpful assistant.")];
    let mut i = 0;
    loop {
        let chunk = words[i % words.len()..]
            .iter()
            .take(120)
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        i += 120;
        messages.push(ChatMessage::user(format!("Summarise: {chunk}")));
        let n = model
            .prompt_tokens(&ChatRequest::new(String::new(), messages.clone(), Vec::new()))
            .expect("tokens")
            .len();
        if n >= 2000 {
            break;
        }
        messages.push(ChatMessage::assistant("It is part of a software licence."));
    }
    let req = |m: &[ChatMessage]| ChatRequest::new(String::new(), m.to_vec(), Vec::new());
    let g1 = model
        .generate(&req(&messages), &AtomicBool::new(false), &mut |_| {})
        .expect("first turn");
    messages.push(ChatMessage::assistant(g1.text.clone()));
    messages.push(ChatMessage::user("Thanks. And in one word?"));
    let g2 = model
        .generate(&req(&messages), &AtomicBool::new(false), &mut |_| {})
        .expect("follow-up");
    let (s1, s2) = (g1.stats, g2.stats);

    println!();
    println!("| what | llama.cpp | tether-gguf | ratio | goal |");
    println!("|---|---|---|---|---|");
    match reference {
        Some((lpp, ltg, lrss)) => {
            println!(
                "| pre-fill tok/s (pp{pp}) | {lpp:.1} | {best_pp:.1} | {:.2}× | ≥ 0.5× |",
                best_pp / lpp
            );
            println!(
                "| decode tok/s (tg{tg}) | {ltg:.1} | {best_tg:.1} | {:.2}× | ≥ 0.8× |",
                best_tg / ltg
            );
            println!(
                "| peak RSS MB | {:.0} | {:.0} | | ≤ {:.0} (GGUF + 150) |",
                lrss as f64 / 1024.0,
                rss as f64 / 1024.0,
                size as f64 / 1e6 + 150.0
            );
        }
        None => {
            println!("| pre-fill tok/s (pp{pp}) | – | {best_pp:.1} | | |");
            println!("| decode tok/s (tg{tg}) | – | {best_tg:.1} | | |");
            println!(
                "| peak RSS MB | – | {:.0} | | ≤ {:.0} |",
                rss as f64 / 1024.0,
                size as f64 / 1e6 + 150.0
            );
        }
    }
    println!(
        "| our CPU time per token (pre-fill + decode, all threads) | | {:.2} ms | {:.2} cores busy | |",
        1000.0 * cpu / per_tok as f64,
        cpu / wall.max(1e-9)
    );
    println!(
        "| time to first token, first turn ({} prompt tokens, {} pre-filled) | | {:.1} ms | | |",
        s1.prompt_tokens,
        s1.prefilled_tokens,
        s1.first_token_us as f64 / 1000.0
    );
    println!(
        "| time to first token, follow-up ({} prompt tokens, {} reused, {} pre-filled) | | {:.1} ms | {:.1} % of the first | ≤ 10 % |",
        s2.prompt_tokens,
        s2.reused_tokens,
        s2.prefilled_tokens,
        s2.first_token_us as f64 / 1000.0,
        100.0 * s2.first_token_us as f64 / s1.first_token_us.max(1) as f64
    );
}
