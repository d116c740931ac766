//! Building an agent's model from its configuration.

use std::sync::Arc;

use tether::ChatModel;

/// An OpenAI-compatible chat model.
pub(crate) fn openai(
    base_url: &str,
    api_key: Option<String>,
    model: &str,
    stream: bool,
) -> Result<Arc<dyn ChatModel>, String> {
    let mut b = tether_openai::OpenAiModel::builder(base_url)
        .model(model)
        .stream(stream);
    if let Some(k) = api_key {
        b = b.api_key(k);
    }
    let m = b.build().map_err(|e| e.to_string())?;
    Ok(Arc::new(m))
}
