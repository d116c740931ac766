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
