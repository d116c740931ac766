//! [`GgufError`]: everything that can go wrong loading or running an embedded model, as a type a
//! caller can match on, each message saying what to do.

use std::path::PathBuf;

/// What to say after a model that cannot be used.
const ALTERNATIVES: &str = "point --gguf (or TETHER_GGUF) at a GGUF file, or --base-url at an \
                            OpenAI-compatible server";

/// A failure of the embedded model.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The model file does not exist.
    #[error("no model file at {}: {ALTERNATIVES}", path.display())]
    NotFound {
        /// The path tried.
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("cannot read {}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The system's message.
        message: String,
    },
    /// The file does not start with the GGUF magic.
    #[error("{} is not a GGUF file (it starts with {found:?}, not \"GGUF\"): {ALTERNATIVES}", path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// Its first bytes.
        found: String,
    },
    /// The file ends before the data its header announces.
    #[error("the GGUF file is truncated ({message}); download it again or {ALTERNATIVES}")]
    Truncated {
        /// What was missing.
        message: String,
    },
    /// The header or a tensor is inconsistent.
    #[error("the GGUF file is corrupt: {0}")]
    Corrupt(String),
    /// A metadata key the model needs is absent.
    #[error("the GGUF file lacks the metadata key `{0}`")]
    MissingMetadata(String),
    /// A tensor the architecture needs is absent.
    #[error("the GGUF file lacks the tensor `{0}`")]
    MissingTensor(String),
    /// `general.architecture` names a model this crate does not run.
    #[error("unsupported model architecture `{0}` (supported: llama, qwen2, qwen3): {ALTERNATIVES}")]
    UnsupportedArchitecture(String),
    /// The tokenizer in the metadata is not one this crate builds.
    #[error("unsupported tokenizer: {0}")]
    UnsupportedTokenizer(String),
    /// The prompt does not fit the context window.
    #[error(
        "the prompt is {prompt} tokens but the context window is {context} (with {reserve} kept for the answer): shorten the conversation or raise the context size"
    )]
    ContextOverflow {
        /// Tokens in the prompt.
        prompt: usize,
        /// The context window.
        context: usize,
        /// Tokens kept free for the answer.
        reserve: usize,
    },
    /// The chat template failed to render.
    #[error("the chat template failed: {0}")]
    Template(String),
    /// The tool grammar could not be built.
    #[error("cannot constrain tool calls: {0}")]
    Grammar(String),
    /// The default model could not be fetched.
    #[error("{0}")]
    Fetch(String),
    /// An error inside the tensor library while running the model.
    #[error("inference failed: {0}")]
    Inference(String),
    /// The generation was cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl GgufError {
    pub(crate) fn candle(e: candle_core::Error) -> Self {
        GgufError::Inference(e.to_string())
    }

    /// A tensor read failure: truncated when the file ends early, corrupt otherwise.
    pub(crate) fn corrupt_or_truncated(what: &str, e: candle_core::Error) -> Self {
        let s = e.to_string();
        if s.contains("remaining") || s.contains("failed to fill whole buffer") || s.contains("UnexpectedEof")
        {
            GgufError::Truncated {
                message: format!("{what}: {s}"),
            }
        } else {
            GgufError::Corrupt(format!("{what}: {s}"))
        }
    }
}

impl From<GgufError> for tether::Error {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Cancelled => tether::Error::Cancelled,
            GgufError::NotFound { .. } => tether::Error::config_with(tether::ConfigKind::Invalid, "", e),
            GgufError::Fetch(_) => tether::Error::config_with(tether::ConfigKind::Setup, "", e),
            other => tether::Error::provider("gguf", other.to_string()),
        }
    }
}
