//! tether-gguf: a [`tether::ChatModel`] that runs a GGUF model in-process on the CPU, in pure
//! Rust, so `tether run "…"` works with no server, no key and no setup.
//!
//! - **Model**: llama (SmolLM2, Llama 2/3), qwen2 and qwen3 decoder stacks over candle's quantized
//!   tensors ([`model`]); the tokenizer ([`tokenizer`]) and chat template ([`template`]) come from
//!   the GGUF's own metadata.
//! - **Tool calls** are constrained while decoding by an llguidance grammar built from the tools'
//!   JSON schemas ([`tools`]): every call parses and matches its tool's schema.
//! - **Between turns** the KV cache of a conversation is kept: a follow-up turn pre-fills only
//!   the tokens after the longest prefix it shares with what is cached ([`TurnStats`]).
//! - **Default model**: SmolLM2-135M-Instruct Q4_1, fetched on first use through the machine's
//!   own `pip` ([`fetch`]).
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use tether::{Session, local::LocalLoop};
//! use tether_gguf::GgufModel;
//! let model = GgufModel::builder(tether_gguf::fetch::default_model()?).build()?;
//! let result = Session::builder(LocalLoop::new(model)).run("Say hello").await?;
//! println!("{}", result.text);
//! # Ok(()) }
//! ```
//!
//! The chat template and tokenizer come from the GGUF itself; a template renders tether's
//! messages the way the model was trained on:
//!
//! ```
//! use tether::ChatMessage;
//! use tether_gguf::template::ChatTemplate;
//! let template = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}",
//!     "<s>",
//!     "</s>",
//! )?;
//! let text = template.render(&[ChatMessage::user("hi")], &[])?;
//! // The message text is wrapped in markers that the tokenizer turns into untrusted-text tokens.
//! assert!(text.starts_with("<|user|>") && text.contains("hi") && text.ends_with("</s>"));
//! # Ok::<(), tether_gguf::error::GgufError>(())
//! ```
#![deny(missing_docs)]

pub mod engine;
pub mod error;
pub mod fetch;
mod kernels;
pub mod model;
pub mod template;
pub mod tokenizer;
pub mod tools;

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use candle_core::quantized::gguf_file;
use serde_json::json;
use tether::event::Role;
use tether::{ChatMessage, ChatModel, ChatRequest, ChatResponse, ChatToolCall, DeltaSink, Usage};

pub use engine::{Sampling, TurnStats};
pub use error::GgufError;
pub use tools::ToolChoice;

use engine::{Engine, Mode, Slot};
use model::{Cache, Weights};
use template::ChatTemplate;
use tokenizer::Tokenizer;
use tools::Piece;

/// Options of a [`GgufModel`], set through [`GgufBuilder`].
#[derive(Debug, Clone)]
struct Options {
    threads: usize,
    context: Option<usize>,
    max_tokens: usize,
    sampling: Sampling,
    stops: Vec<String>,
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    slots: usize,
}

/// Builds a [`GgufModel`] from a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufBuilder {
    path: PathBuf,
    opts: Options,
}

impl GgufBuilder {
    /// Threads for the matrix products (default: the machine's cores).
    pub fn threads(mut self, n: usize) -> Self {
        self.opts.threads = n;
        self
    }

    /// The context window in tokens (default: the model's trained context, at most 8,192).
    pub fn context(mut self, n: usize) -> Self {
        self.opts.context = Some(n);
        self
    }

    /// The most tokens one answer may have (default 1,024); the answer ends with `length`.
    pub fn max_tokens(mut self, n: usize) -> Self {
        self.opts.max_tokens = n;
        self
    }

    /// How tokens are chosen (default temperature 0.2, top-p 0.95, top-k 40, a fresh seed).
    pub fn sampling(mut self, s: Sampling) -> Self {
        self.opts.sampling = s;
        self
    }

    /// Strings that end an answer (not included in it).
    pub fn stop(mut self, stops: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.opts.stops = stops.into_iter().map(Into::into).collect();
        self
    }

    /// `tool_choice` for model calls that answer a user message (default `auto`). Calls that
    /// answer tool results always use `auto`, so a forced call cannot loop forever.
    pub fn tool_choice(mut self, c: ToolChoice) -> Self {
        self.opts.tool_choice = c;
        self
    }

    /// Whether one answer may hold several tool calls (default `false`: one call, then the
    /// answer ends, as llama.cpp's server does unless asked for parallel calls). With `true`
    /// the grammar lets the model open another call after each one, and small models tend to
    /// keep calling until their token budget runs out.
    pub fn parallel_tool_calls(mut self, yes: bool) -> Self {
        self.opts.parallel_tool_calls = yes;
        self
    }

    /// Conversations whose KV caches are kept at once (default 1; each costs its cache's memory).
    pub fn slots(mut self, n: usize) -> Self {
        self.opts.slots = n.max(1);
        self
    }

    /// Loads the model.
    pub fn build(self) -> Result<GgufModel, GgufError> {
        GgufModel::load(self.path, self.opts)
    }
}

/// A GGUF model running in-process: a [`ChatModel`] for tether's local loop.
///
/// Cloning is cheap (the weights are shared).
#[derive(Clone)]
pub struct GgufModel {
    inner: Arc<Inner>,
    opts: Options,
}

struct Inner {
    engine: Engine,
    template: ChatTemplate,
    name: String,
    path: PathBuf,
    arch: model::Arch,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("name", &self.inner.name)
            .field("path", &self.inner.path)
            .finish()
    }
}

/// Opens a GGUF file and reads its header, with typed errors for every way it can be wrong.
pub fn read_header(path: &Path) -> Result<(gguf_file::Content, BufReader<File>), GgufError> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => GgufError::NotFound {
            path: path.to_owned(),
        },
        _ => GgufError::Io {
            path: path.to_owned(),
            message: e.to_string(),
        },
    })?;
    if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(GgufError::Io {
            path: path.to_owned(),
            message: "it is a directory".into(),
        });
    }
    let mut r = BufReader::new(file);
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => {
                return Err(GgufError::Io {
                    path: path.to_owned(),
                    message: e.to_string(),
                });
            }
        }
    }
    if &magic[..got] != b"GGUF" {
        if got < 4 && b"GGUF".starts_with(&magic[..got]) {
            return Err(GgufError::Truncated {
                message: format!("{} is {got} bytes long", path.display()),
            });
        }
        return Err(GgufError::BadMagic {
            path: path.to_owned(),
            found: String::from_utf8_lossy(&magic[..got]).escape_debug().to_string(),
        });
    }
    use std::io::Seek;
    r.seek(std::io::SeekFrom::Start(0)).map_err(|e| GgufError::Io {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    // candle's reader bounds every length by the file, but divides by `general.alignment`
    // unchecked: an alignment of 0 panics there, and is a corrupt header here.
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gguf_file::Content::read(&mut r)))
        .map_err(|_| GgufError::Corrupt("the header cannot be read (a zero `general.alignment`?)".into()))?;
    let ct = read.map_err(|e| {
        let s = e.to_string();
        if s.contains("failed to fill whole buffer") || s.contains("remaining") || s.contains("UnexpectedEof")
        {
            GgufError::Truncated { message: s }
        } else {
            GgufError::Corrupt(s)
        }
    })?;
    Ok((ct, r))
}

fn catch<T>(what: &str, f: impl FnOnce() -> Result<T, GgufError>) -> Result<T, GgufError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".into());
            Err(GgufError::Inference(format!("{what}: {msg}")))
        }
    }
}

impl GgufModel {
    /// A builder for the model in `path`.
    pub fn builder(path: impl Into<PathBuf>) -> GgufBuilder {
        GgufBuilder {
            path: path.into(),
            opts: Options {
                threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
                context: None,
                max_tokens: 1024,
                sampling: Sampling::default(),
                stops: Vec::new(),
                tool_choice: ToolChoice::Auto,
                parallel_tool_calls: false,
                slots: 1,
            },
        }
    }

    fn load(path: PathBuf, opts: Options) -> Result<Self, GgufError> {
        catch("loading the model", move || {
            let (ct, mut r) = read_header(&path)?;
            // Every check that needs only the header, before any tensor data is read: tensor
            // types, shapes and data ranges, the hyper-parameters against each other, the
            // tokenizer against the embedding.
            let file_len = r
                .get_ref()
                .metadata()
                .map(|m| m.len())
                .map_err(|e| GgufError::Io {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            model::check_tensors(&ct, file_len)?;
            let cfg = model::config_of(&ct)?;
            let tok = Arc::new(Tokenizer::from_gguf(&ct)?);
            if cfg.vocab < tok.vocab_size() {
                return Err(GgufError::Corrupt(format!(
                    "the embedding has {} rows for {} tokens",
                    cfg.vocab,
                    tok.vocab_size()
                )));
            }
            let trained = cfg.context_length;
            let context = opts
                .context
                .unwrap_or(trained.min(8192))
                .clamp(16, trained.max(16));
            let weights = Weights::load(&ct, &mut r, context)?;
            let src = match ct.metadata.get("tokenizer.chat_template") {
                Some(gguf_file::Value::String(s)) => s.clone(),
                _ => template::CHATML.to_owned(),
            };
            let text_of =
                |id: Option<u32>| id.map(|i| String::from_utf8_lossy(tok.token_bytes(i)).into_owned());
            let template = ChatTemplate::new(
                &src,
                &text_of(tok.bos).unwrap_or_default(),
                &text_of(Some(tok.eos)).unwrap_or_default(),
            )?;
            let name = match ct.metadata.get("general.name") {
                Some(gguf_file::Value::String(s)) if !s.is_empty() => s.clone(),
                _ => path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "gguf".into()),
            };
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(opts.threads.max(1))
                .thread_name(|i| format!("gguf-{i}"))
                .build()
                .map_err(|e| GgufError::Inference(format!("cannot start threads: {e}")))?;
            let slots = (0..opts.slots)
                .map(|_| {
                    Mutex::new(Slot {
                        cache: Cache::new(&weights),
                        tokens: Vec::new(),
                    })
                })
                .collect();
            let env = engine::tok_env(&tok);
            let arch = weights.cfg.arch;
            Ok(GgufModel {
                inner: Arc::new(Inner {
                    engine: Engine {
                        weights,
                        tok,
                        env,
                        factory: Mutex::new(None),
                        slots,
                        pool,
                        context,
                        last: Mutex::new(TurnStats::default()),
                        totals: Mutex::new(TurnStats::default()),
                    },
                    template,
                    name,
                    path,
                    arch,
                }),
                opts,
            })
        })
    }

    /// The same loaded model (weights and KV caches shared) with other sampling options.
    pub fn with_sampling(&self, s: Sampling) -> Self {
        let mut m = self.clone();
        m.opts.sampling = s;
        m
    }

    /// The same loaded model with another `tool_choice` (see [`GgufBuilder::tool_choice`]).
    pub fn with_tool_choice(&self, c: ToolChoice) -> Self {
        let mut m = self.clone();
        m.opts.tool_choice = c;
        m
    }

    /// The model's name (`general.name`, or the file's stem).
    pub fn model_name(&self) -> &str {
        &self.inner.name
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The architecture.
    pub fn arch(&self) -> model::Arch {
        self.inner.arch
    }

    /// The context window in tokens.
    pub fn context(&self) -> usize {
        self.inner.engine.context
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> u64 {
        self.inner.engine.weights.bytes
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.engine.tok
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// Counters of the last generation.
    pub fn last_stats(&self) -> TurnStats {
        self.inner.engine.last.lock().map(|g| *g).unwrap_or_default()
    }

    /// Counters summed over every generation so far.
    pub fn total_stats(&self) -> TurnStats {
        self.inner.engine.totals.lock().map(|g| *g).unwrap_or_default()
    }

    /// The prompt tokens for a request, as [`ChatModel::chat`] builds them.
    pub fn prompt_tokens(&self, req: &ChatRequest) -> Result<Vec<u32>, GgufError> {
        let (tools, _) = self.tools_and_mode(req)?;
        let marked = self.inner.template.render(&req.messages, &tools)?;
        self.inner.engine.tok.encode_marked(&marked)
    }

    fn tools_and_mode(&self, req: &ChatRequest) -> Result<(Vec<tether::ToolSpec>, Mode), GgufError> {
        if req.tools.is_empty() {
            return Ok((Vec::new(), Mode::Text));
        }
        // A forced choice applies to the call that answers the user, not to calls that answer
        // tool results (which would loop).
        let answering_user = req.messages.last().is_none_or(|m| m.role != Role::Tool);
        let choice = if answering_user {
            self.opts.tool_choice.clone()
        } else {
            ToolChoice::Auto
        };
        let par = self.opts.parallel_tool_calls;
        let grammar =
            |only: Option<&str>| tools::call_grammar(&req.tools, only, par).map_err(GgufError::Grammar);
        Ok(match choice {
            ToolChoice::None => (Vec::new(), Mode::Text),
            ToolChoice::Auto => (req.tools.clone(), Mode::Auto(grammar(None)?)),
            ToolChoice::Required => (req.tools.clone(), Mode::Calls(grammar(None)?)),
            ToolChoice::Named(n) => (req.tools.clone(), Mode::Calls(grammar(Some(&n))?)),
        })
    }

    /// Generates an answer to `req` on the calling thread, handing each piece to `out`; stops
    /// between two tokens once `cancel` is set. [`ChatModel::chat`] runs this on a blocking task.
    pub fn generate(
        &self,
        req: &ChatRequest,
        cancel: &AtomicBool,
        out: &mut dyn FnMut(Piece),
    ) -> Result<engine::Generated, GgufError> {
        catch("generation", || {
            let (tools, mode) = self.tools_and_mode(req)?;
            let marked = self.inner.template.render(&req.messages, &tools)?;
            let prompt = self.inner.engine.tok.encode_marked(&marked)?;
            let o = &self.opts;
            self.inner
                .engine
                .generate(&prompt, &mode, &o.sampling, o.max_tokens, &o.stops, cancel, out)
        })
    }

    /// Perplexity of `text` as llama.cpp's `llama-perplexity -c n_ctx --chunks chunks` computes
    /// it (for the reference tests).
    pub fn perplexity(&self, text: &str, n_ctx: usize, chunks: usize) -> Result<f64, GgufError> {
        let tokens = self.inner.engine.tok.encode(text, false)?;
        catch("perplexity", || {
            self.inner.engine.perplexity(&tokens, n_ctx, chunks)
        })
    }

    /// For the benchmark: on a fresh cache, pre-fills `prompt` then decodes `n` tokens greedily
    /// whatever they are (as `llama-bench` does); returns the two durations.
    #[doc(hidden)]
    pub fn bench_tokens(
        &self,
        prompt: &[u32],
        n: usize,
    ) -> Result<(std::time::Duration, std::time::Duration), GgufError> {
        catch("bench", || self.inner.engine.bench(prompt, n))
    }

    /// Greedy continuation of a raw prompt (special tokens parsed, BOS as the model wants),
    /// `n` tokens or fewer when the model ends: for the reference tests.
    pub fn greedy(&self, prompt: &str, n: usize) -> Result<Vec<u32>, GgufError> {
        let mut ids = Vec::new();
        let tok = &self.inner.engine.tok;
        if tok.add_bos
            && let Some(b) = tok.bos
        {
            ids.push(b);
        }
        ids.extend(tok.encode(prompt, true)?);
        catch("greedy", || self.inner.engine.greedy(&ids, n))
    }
}

/// Sets the flag when dropped: a dropped `chat` future stops its generation.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[async_trait]
impl ChatModel for GgufModel {
    fn name(&self) -> &str {
        "gguf"
    }

    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        let cancel = Arc::new(AtomicBool::new(false));
        let _guard = CancelOnDrop(cancel.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Piece>();
        let me = self.clone();
        let req2 = req.clone();
        let flag = cancel.clone();
        let job = tokio::task::spawn_blocking(move || {
            me.generate(&req2, &flag, &mut |p| {
                let _ = tx.send(p);
            })
        });
        while let Some(p) = rx.recv().await {
            match p {
                Piece::Text(t) => deltas.text(&t).await,
                Piece::CallStart { id, name } => deltas.tool_call_start(&id, &name).await,
                Piece::CallArgs { id, delta } => deltas.tool_call_args(&id, &delta).await,
                Piece::CallEnd { id } => deltas.tool_call_end(&id).await,
            }
        }
        let g = job
            .await
            .map_err(|e| tether::Error::provider("gguf", format!("the generation task failed: {e}")))??;
        let s = g.stats;
        let usage = Usage::new(s.prompt_tokens as u64, s.generated_tokens as u64)
            .with_cache_read_tokens(s.reused_tokens as u64)
            .with_raw(json!({
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.generated_tokens,
                "cached_tokens": s.reused_tokens,
                "prefilled_tokens": s.prefilled_tokens,
            }));
        let mut message = ChatMessage::assistant(g.text.clone());
        if g.text.is_empty() && !g.calls.is_empty() {
            message.content = None;
        }
        message.tool_calls = g
            .calls
            .iter()
            .map(|c| ChatToolCall::new(c.id.clone(), c.name.clone(), c.arguments.clone()))
            .collect();
        let raw = json!({
            "model": self.inner.name,
            "finish_reason": g.finish_reason,
            "text": g.text,
            "tool_calls": message.tool_calls,
            "timings": {"prefill_us": s.prefill_us, "first_token_us": s.first_token_us, "decode_us": s.decode_us},
        });
        Ok(ChatResponse::new(message)
            .with_finish_reason(g.finish_reason)
            .with_usage(usage)
            .with_raw(raw))
    }
}
