#!/usr/bin/env python3
"""Writes tiny synthetic qwen2 and qwen3 GGUFs for the reference tests.

No Qwen GGUF small enough for CI is on a registry we can reach, so the qwen2 and qwen3 code
paths are checked against llama.cpp on models made here: random weights from a fixed seed, laid
out exactly as the real Qwen GGUFs are (the same tensor names, metadata keys, NeoX RoPE, a
byte-level BPE vocabulary with the `qwen2` pre-tokenizer and ChatML control tokens), written with
`gguf-py`, the GGUF writer llama.cpp itself ships (taken from the llama.cpp source tree
scripts/reference.sh builds). What each model exercises:

  tiny-qwen2.gguf  q/k/v biases; an untied `output.weight`; Q8_0 matrices (stacked q/k/v and
                   gate/up products), a Q4_1 attention output, an F16 `ffn_down` (candle's
                   product); head_dim = n_embd / n_head.
  tiny-qwen3.gguf  per-head q/k RMS norms; tied embeddings (no `output.weight`); Q4_1 q and k
                   with a Q8_0 v (the products apart); `attention.key_length` set so that
                   n_head * head_dim != n_embd, as in the real Qwen 3 models.

    PYTHONPATH=<llama.cpp>/gguf-py python3 synthetic.py OUT_DIR TEXT_FILE

The vocabulary is the 256 byte tokens, merges learned from TEXT_FILE, and the control tokens
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`. Everything is deterministic: the same inputs and
the same gguf-py give the same bytes.
"""
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

N_MERGES = 250
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_chars():
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def vocabulary(text):
    """Byte tokens, then N_MERGES merges learned greedily from `text`, then the control tokens."""
    table = byte_chars()
    tokens = [table[b] for b in range(256)]
    # Words as a GPT-2-like pre-tokenizer cuts them (an optional space, then letters, digits or
    # other): good enough to learn merges; the tokenizers under test use the real regexes.
    words = Counter(re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text))
    seqs = {w: [table[b] for b in w.encode("utf-8")] for w in words}
    merges = []
    known = set(tokens)
    while len(merges) < N_MERGES:
        pairs = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        # Most frequent, ties by the pair itself: deterministic.
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        if a + b not in known:
            tokens.append(a + b)
            known.add(a + b)
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(CONTROL)
    return tokens + CONTROL, types, merges


def quant(a, qtype):
    """`a` (rows, cols) as the raw bytes of `qtype`, with the logical shape for the writer."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == Q.F32:
        return a, None
    if qtype == Q.F16:
        return a.astype(np.float16), None
    return gguf.quants.quantize(a, qtype), qtype


def write(path, arch, text, seed):
    rng = np.random.RandomState(seed)
    tokens, types, merges = vocabulary(text)
    n_vocab = len(tokens)
    eot = tokens.index("<|endoftext|>")
    im_end = tokens.index("<|im_end|>")
    if arch == "qwen2":
        n_embd, n_head, n_kv, head_dim, n_ff, n_layer = 64, 4, 2, 16, 128, 2
    else:
        n_embd, n_head, n_kv, head_dim, n_ff, n_layer = 64, 4, 2, 32, 128, 2
    qd, kvd = n_head * head_dim, n_kv * head_dim

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch} (synthetic, seed {seed})")
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(im_end)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(name, a, qtype):
        data, raw = quant(a, qtype)
        w.add_tensor(name, data, raw_dtype=raw)

    def mat(rows, cols, scale):
        return rng.randn(rows, cols).astype(np.float32) * np.float32(scale / np.sqrt(cols))

    def norm(n, mean=1.0, spread=0.1):
        return (mean + spread * rng.randn(n)).astype(np.float32)

    embd = rng.randn(n_vocab, n_embd).astype(np.float32)
    # Control tokens' rows small, so a greedy continuation rarely ends at one (the tests
    # compare 16 tokens).
    embd[len(tokens) - len(CONTROL):] *= 0.05
    t("token_embd.weight", embd, Q.Q8_0)
    if arch == "qwen2":
        out = mat(n_vocab, n_embd, 3.0)
        out[len(tokens) - len(CONTROL):] *= 0.05
        t("output.weight", out, Q.Q8_0)
        t("output_norm.weight", norm(n_embd), Q.F32)
    else:
        # Tied: the logits are the embedding times the final norm (RMS ~ 3 with these scales).
        t("output_norm.weight", norm(n_embd, 3.0 / np.sqrt(n_embd), 0.05), Q.F32)
    for i in range(n_layer):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", norm(n_embd), Q.F32)
        if arch == "qwen2":
            t(p + "attn_q.weight", mat(qd, n_embd, 1.5), Q.Q8_0)
            t(p + "attn_k.weight", mat(kvd, n_embd, 1.5), Q.Q8_0)
            t(p + "attn_v.weight", mat(kvd, n_embd, 1.0), Q.Q8_0)
            t(p + "attn_q.bias", (0.2 * rng.randn(qd)).astype(np.float32), Q.F32)
            t(p + "attn_k.bias", (0.2 * rng.randn(kvd)).astype(np.float32), Q.F32)
            t(p + "attn_v.bias", (0.2 * rng.randn(kvd)).astype(np.float32), Q.F32)
            t(p + "attn_output.weight", mat(n_embd, qd, 1.0), Q.Q4_1)
            t(p + "ffn_down.weight", mat(n_embd, n_ff, 1.0), Q.F16)
        else:
            t(p + "attn_q.weight", mat(qd, n_embd, 1.5), Q.Q4_1)
            t(p + "attn_k.weight", mat(kvd, n_embd, 1.5), Q.Q4_1)
            t(p + "attn_v.weight", mat(kvd, n_embd, 1.0), Q.Q8_0)
            t(p + "attn_q_norm.weight", norm(head_dim, 1.5, 0.2), Q.F32)
            t(p + "attn_k_norm.weight", norm(head_dim, 1.5, 0.2), Q.F32)
            # Larger outputs than qwen2's: with tied embeddings, a residual stream dominated
            # by the input embedding predicts the input token again and again.
            t(p + "attn_output.weight", mat(n_embd, qd, 4.0), Q.Q8_0)
            t(p + "ffn_down.weight", mat(n_embd, n_ff, 4.0), Q.Q8_0)
        t(p + "ffn_norm.weight", norm(n_embd), Q.F32)
        t(p + "ffn_gate.weight", mat(n_ff, n_embd, 1.5), Q.Q8_0)
        t(p + "ffn_up.weight", mat(n_ff, n_embd, 1.0), Q.Q8_0)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out, text = Path(sys.argv[1]), Path(sys.argv[2]).read_text(encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    for arch, seed in (("qwen2", 2), ("qwen3", 3)):
        p = out / f"tiny-{arch}.gguf"
        write(p, arch, text, seed)
        print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
