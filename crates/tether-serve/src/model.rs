//! Building an agent's model from its configuration.

use std::sync::Arc;

use tether::ChatModel;

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
