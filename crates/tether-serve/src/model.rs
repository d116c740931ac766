//! Building an agent's model from its configuration.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use tether::ChatModel;

use crate::config::AgentConfig;

/// The read buffer of each upstream connection. A server relays many streams at once, and a
/// local model outruns the relay: with hyper's growing buffer each stream held 150–250 KiB at
/// 1,000 concurrent runs; with a fixed 8 KiB one the whole run fits in the 64 KiB.
const UPSTREAM_READ_BUFFER: usize = 8 * 1024;

/// An OpenAI-compatible chat model.
pub(crate) fn openai(
    base_url: &str,
    api_key: Option<String>,
    model: &str,
    stream: bool,
) -> Result<Arc<dyn ChatModel>, String> {
    let mut b = tether_openai::OpenAiModel::builder(base_url)
        .model(model)
        .stream(stream)
        .read_buffer(UPSTREAM_READ_BUFFER);
    if let Some(k) = api_key {
        b = b.api_key(k);
    }
    let m = b.build().map_err(|e| e.to_string())?;
    Ok(Arc::new(m))
}

/// The model of an agent: its provider's (`openai` or `gguf`).
pub(crate) fn of(
    cfg: &AgentConfig,
    base_url: &str,
    api_key: Option<String>,
    model: &str,
) -> Result<Arc<dyn ChatModel>, String> {
    match cfg.provider.as_str() {
        "gguf" => gguf(cfg.gguf.clone()),
        _ => openai(base_url, api_key, model, cfg.stream),
    }
}

/// Conversations whose KV caches an embedded model keeps at once in `tether serve`.
const GGUF_SLOTS: usize = 4;

/// A GGUF model run in-process: `path`, else `$TETHER_GGUF`, else the default model (fetched on
/// first use). Agents naming the same file share one loaded model.
pub(crate) fn gguf(path: Option<PathBuf>) -> Result<Arc<dyn ChatModel>, String> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, tether_gguf::GgufModel>>> = OnceLock::new();
    let explicit = path.or_else(|| {
        std::env::var_os("TETHER_GGUF")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let path = match explicit {
        Some(p) => p,
        None => tether_gguf::fetch::default_model().map_err(|e| e.to_string())?,
    };
    let loaded = LOADED.get_or_init(Default::default);
    let mut map = loaded
        .lock()
        .map_err(|_| "the model cache is poisoned".to_owned())?;
    if let Some(m) = map.get(&path) {
        return Ok(Arc::new(m.clone()));
    }
    let m = tether_gguf::GgufModel::builder(&path)
        .slots(GGUF_SLOTS)
        .build()
        .map_err(|e| e.to_string())?;
    eprintln!(
        "tether serve: embedded model {} ({})",
        m.model_name(),
        path.display()
    );
    map.insert(path, m.clone());
    Ok(Arc::new(m))
}
