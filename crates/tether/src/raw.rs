//! The raw types the session engine, the event sink and the local loop write, in one place.
//!
//! Every [`crate::Event`] carries a namespaced raw type. Providers name their own (`acp.*`,
//! `agent.*`, `agentcore.*`); the ones below are tether's: what the engine records about a session
//! (`tether.*`) and what the local loop records of its model calls (`local.*`). Code that reads a
//! record (the local loop rebuilding its history, a front-end projecting messages, a test) matches
//! on these constants, never on a string of its own.

/// A user message, recorded once by the engine before the turn that sends it. Its event id is
/// `user:` and the caller's message id when it has one; its raw payload is `{"id", "text"}`.
pub const USER_MESSAGE: &str = "tether.user_message";
/// A user message as `tether serve` recorded it before its agents moved onto the session
/// engine's own record (same event id and payload as [`USER_MESSAGE`]). Written no more; read
/// as a user message, so a database of that version keeps its threads readable and resumable.
pub const LEGACY_SERVE_USER_MESSAGE: &str = "serve.user_message";
/// A tool result, recorded once (event id `tool_result:` and the use's memo key).
pub const TOOL_RESULT: &str = "tether.tool_result";
/// A dropped stream the engine reconnects (attempt, delay, error).
pub const RECONNECT: &str = "tether.reconnect";
/// The re-prompt sent when the model ended its turn without the terminal tool.
pub const REPROMPT: &str = "tether.reprompt";
/// A recorded tool result was forgotten, so the same tool use runs again.
pub const TOOL_RESULT_FORGOTTEN: &str = "tether.tool_result_forgotten";
/// A question a provider asked mid-turn (a permission request) that no one can answer any more:
/// the process holding the turn that asked it ended (a restart, a crash, an eviction).
pub const QUESTION_LOST: &str = "tether.question_lost";
/// Live only: the content of a message starts over (see [`crate::EventKind::MessageRestart`]).
pub const RESTART: &str = "tether.restart";
/// Live only: content of a restarted message delivered again.
pub const REPLAY: &str = "tether.replay";

/// One model response of the local loop: `{"message": ChatMessage, "finish_reason", "usage",
/// "response"}`. Its event id is the message id.
pub const LOCAL_MODEL_RESPONSE: &str = "local.model_response";
/// A directive the local loop added to its history as a user message (`{"role", "text"}`: a
/// corrective after repeated tool errors, the final-turn notice).
pub const LOCAL_DIRECTIVE: &str = "local.directive";
/// A tool call the local loop answered itself as a repeat of an earlier one (`{"id", "name",
/// "input"}`; the directive text is in the event's kind).
pub const LOCAL_DUPLICATE_TOOL_CALL: &str = "local.duplicate_tool_call";
/// A model call the local loop retries after a transient failure.
pub const LOCAL_RETRY: &str = "local.retry";
/// The token usage of one model call of the local loop.
pub const LOCAL_USAGE: &str = "local.usage";
/// Live only: a piece of assistant text.
pub const LOCAL_TEXT_DELTA: &str = "local.text_delta";
/// Live only: a piece of reasoning text.
pub const LOCAL_REASONING_DELTA: &str = "local.reasoning_delta";
/// Live only: a reasoning block's signature.
pub const LOCAL_REASONING_SIGNATURE: &str = "local.reasoning_signature";
/// Live only: a tool call began streaming.
pub const LOCAL_TOOL_CALL_START: &str = "local.tool_call_start";
/// Live only: a piece of a tool call's arguments.
pub const LOCAL_TOOL_CALL_ARGS: &str = "local.tool_call_args";
/// Live only: a tool call's arguments are complete.
pub const LOCAL_TOOL_CALL_END: &str = "local.tool_call_end";
