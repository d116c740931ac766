//! Shared by the model tests: the default model, fetched on first use (scripts/test fetches it
//! into the cache before `cargo test`), loaded once per test binary.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use tether_gguf::{GgufModel, Sampling, ToolChoice};

/// The default model's path, fetching it if the cache lacks it.
pub fn model_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| match tether_gguf::fetch::default_model() {
        Ok(p) => p,
        Err(e) => panic!("the default model is needed for this test and could not be had: {e}"),
    })
    .clone()
}

/// A model with `threads = 2`, greedy unless `sampling` says otherwise.
pub fn model(choice: ToolChoice, sampling: Sampling, max_tokens: usize) -> GgufModel {
    match GgufModel::builder(model_path())
        .threads(2)
        .tool_choice(choice)
        .sampling(sampling)
        .max_tokens(max_tokens)
        .build()
    {
        Ok(m) => m,
        Err(e) => panic!("loading the default model: {e}"),
    }
}

/// Greedy sampling.
pub fn greedy() -> Sampling {
    Sampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: Some(0),
    }
}

/// Held by each test that runs the model: the tests of a binary take turns, since candle's
/// matrix products share one process-wide worker pool and parallel runs only contend for it.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}
