fn main() {
    let path = tether_gguf::fetch::default_model().unwrap();
    let t = std::time::Instant::now();
    let m = tether_gguf::GgufModel::builder(path).build().unwrap();
    eprintln!(
        "loaded in {:?}: {} ctx {}",
        t.elapsed(),
        m.model_name(),
        m.context()
    );
    let tok = m.tokenizer();
    for s in [
        "Hello world",
        "numbers 1234567 and 3.14159",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = tok.encode(s, true).unwrap();
        println!("{s:?} -> {ids:?} -> {:?}", tok.decode(&ids));
    }
    for p in [
        "The capital of France is",
        "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n",
    ] {
        let t = std::time::Instant::now();
        let ids = m.greedy(p, 24).unwrap();
        println!("{p:?} -> {ids:?} {:?} in {:?}", tok.decode(&ids), t.elapsed());
    }
    let text = std::fs::read_to_string("crates/tether-gguf/tests/data/ppl.txt").unwrap();
    let t = std::time::Instant::now();
    println!("ppl {:?} in {:?}", m.perplexity(&text, 256, 4), t.elapsed());
    println!("tokens in text: {}", tok.encode(&text, false).unwrap().len());
}
