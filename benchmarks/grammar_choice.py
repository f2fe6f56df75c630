"""Grammar library choice: llguidance vs xgrammar on a realistic tokenizer and JSON schemas.

Builds a byte-level BPE tokenizer (trained here with `tokenizers` on local Python sources plus JSON
text, to a Llama-3-sized vocabulary with Llama-3's special tokens), then for each library measures:

- tokenizer setup time (once per worker);
- compile time per schema (what a request pays before its first step; cache off);
- per-token mask time at batch 1 (mean, p99), walking a valid compact JSON document token by token;
- one step's masks for a batch of 256 constrained requests at different positions, serially and with
  the library's own thread pool.

Every walk checks that the document's next token is allowed by the mask, so both libraries are
checked to accept the same documents. Usage (about 2 minutes on 2 cores, most of it BPE training,
cached in /tmp):

    python benchmarks/grammar_choice.py [--vocab 128000] [--json-out F]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import numpy as np

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(250)]

# (schema, a valid instance): the walk feeds the instance's tokens through each library's matcher.
SCHEMAS: list[tuple[dict, object]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org"},
    ),
    (
        {
            "type": "object",
            "properties": {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["label", "confidence"],
            "additionalProperties": False,
        },
        {"label": "neutral", "confidence": 0.75},
    ),
    (
        {
            "type": "object",
            "properties": {
                "entities": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "text": {"type": "string"},
                            "type": {"enum": ["PERSON", "ORG", "LOC", "DATE"]},
                            "start": {"type": "integer", "minimum": 0},
                        },
                        "required": ["text", "type", "start"],
                        "additionalProperties": False,
                    },
                    "maxItems": 8,
                }
            },
            "required": ["entities"],
            "additionalProperties": False,
        },
        {
            "entities": [
                {"text": "Marie Curie", "type": "PERSON", "start": 0},
                {"text": "Sorbonne", "type": "ORG", "start": 25},
                {"text": "Paris", "type": "LOC", "start": 37},
            ]
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "exclusiveMinimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "tags", "in_stock"],
            "additionalProperties": False,
        },
        {"sku": "ABC-1234", "price": 19.99, "tags": ["kitchen", "steel"], "in_stock": True},
    ),
    (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "street": {"type": "string"},
                                "city": {"type": "string"},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["street", "city", "zip"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                },
            },
            "required": ["order_id", "customer", "items"],
            "additionalProperties": False,
        },
        {
            "order_id": 1001,
            "customer": {
                "name": "Bo",
                "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
            },
            "items": [{"sku": "X1", "qty": 2}, {"sku": "Y7", "qty": 1}],
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "answer": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "sources": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["answer", "sources"],
            "additionalProperties": False,
        },
        {"answer": None, "sources": [3, 14, 15]},
    ),
    (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 80},
                "summary": {"type": "string"},
                "keywords": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
                "language": {"enum": ["en", "fr", "de", "es"]},
            },
            "required": ["title", "summary", "keywords", "language"],
            "additionalProperties": False,
        },
        {
            "title": "Grammar-constrained decoding",
            "summary": "Masks disallowed tokens at each step so the output always parses.",
            "keywords": ["grammar", "decoding"],
            "language": "en",
        },
    ),
    (
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            },
            "required": ["date", "temperature_c", "conditions"],
            "additionalProperties": False,
        },
        {"date": "2026-11-30", "temperature_c": -3.5, "conditions": "snow"},
    ),
    (
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                    "maxItems": 3,
                },
                "ok": {"type": "boolean"},
            },
            "required": ["matrix", "ok"],
            "additionalProperties": False,
        },
        {"matrix": [[1, 2, 3], [4, 5, 6]], "ok": False},
    ),
    (
        {
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "thought": {"type": "string"},
                            "action": {"enum": ["search", "lookup", "finish"]},
                        },
                        "required": ["thought", "action"],
                        "additionalProperties": False,
                    },
                    "maxItems": 5,
                },
                "final_answer": {"type": "string"},
            },
            "required": ["steps", "final_answer"],
            "additionalProperties": False,
        },
        {
            "steps": [
                {"thought": "Look up the capital.", "action": "search"},
                {"thought": "Found it.", "action": "finish"},
            ],
            "final_answer": "Canberra",
        },
    ),
]


def compact(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


_WORDS = (
    "id name type value text items data user status date time count price title label score city "
    "email url code message error result source target start end first last total amount level "
    "tags key query answer the of and to in is for on with as by at from this that new old red big"
).split()


def _random_json(rng, depth: int):
    """Random JSON of the usual shapes (not the benchmark's documents, which stay unseen in training)."""
    kind = int(rng.integers(7 if depth < 3 else 5))
    if kind == 0:
        return int(rng.integers(-1000, 100000))
    if kind == 1:
        return round(float(rng.normal(0, 100)), int(rng.integers(1, 4)))
    if kind == 2:
        return " ".join(_WORDS[int(i)] for i in rng.integers(len(_WORDS), size=int(rng.integers(1, 6))))
    if kind == 3:
        return bool(rng.integers(2))
    if kind == 4:
        return None
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    keys = rng.choice(len(_WORDS), size=int(rng.integers(1, 5)), replace=False)
    return {_WORDS[int(k)]: _random_json(rng, depth + 1) for k in keys}


def build_tokenizer(vocab_size: int, cache_dir: str = "/tmp/cbq_grammar_bench", path: str | None = None):
    """A byte-level BPE like Llama-3's: trained here, cached on disk; returns a PreTrainedTokenizerFast.
    `path`: a tokenizer.json trained earlier (to run on another machine without retraining)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = path or os.path.join(cache_dir, f"bpe{vocab_size}.json")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        import sysconfig

        # Local text only: every Python source of the environment, plus any English docs the OS carries.
        files = sorted(
            glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True)
        )
        files += sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt"))
        corpus_path = os.path.join(cache_dir, "json_corpus.txt")
        rng = np.random.default_rng(0)
        with open(corpus_path, "w") as f:  # random JSON, so JSON punctuation pairs become tokens too
            for _ in range(20000):
                doc = _random_json(rng, depth=0)
                f.write(compact(doc) + "\n" + json.dumps(doc, indent=2) + "\n")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        t0 = time.perf_counter()
        tok.train(files + [corpus_path], trainer)
        tok.add_special_tokens(SPECIALS)
        tok.save(path)
        print(
            f"trained BPE ({tok.get_vocab_size()} tokens) in {time.perf_counter() - t0:.1f}s", file=sys.stderr
        )
    return PreTrainedTokenizerFast(
        tokenizer_file=path, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )


def installed_mib(dist: str) -> float:
    """Size of an installed distribution's files (what a worker image carries for it)."""
    from importlib.metadata import distribution

    d = distribution(dist)
    return round(sum(os.path.getsize(d.locate_file(f)) for f in d.files or ()) / 2**20, 1)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# -- llguidance ------------------------------------------------------------------------------------------
class LLG:
    name = "llguidance"

    def __init__(self, hf_tok, num_threads: int):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=len(hf_tok))
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads)
        self.vocab = len(hf_tok)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, row: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def fill_batch(self, matchers, bitmask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.ctypes.data,
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def accepts_eos(self, m, eos: int, row: np.ndarray) -> bool:
        self.fill(m, row)
        return bool((row[eos // 32] >> (eos % 32)) & 1)


# -- xgrammar --------------------------------------------------------------------------------------------
class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok, num_threads: int):
        import torch
        import xgrammar

        self.xgr = xgrammar
        self.torch = torch
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgrammar.BatchGrammarMatcher(num_threads)
        self.vocab = len(hf_tok)

    def compile(self, schema: dict):
        cg = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(cg)

    def fill(self, m, row: np.ndarray) -> None:
        m.fill_next_token_bitmask(self.torch.from_numpy(row[None]))

    def consume(self, m, token: int) -> None:
        assert m.accept_token(token), "xgrammar rejected a valid token"

    def fill_batch(self, matchers, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, self.torch.from_numpy(bitmask))

    def accepts_eos(self, m, eos: int, row: np.ndarray) -> bool:
        self.fill(m, row)
        return bool((row[eos // 32] >> (eos % 32)) & 1)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def bench_library(lib, docs: list[list[int]], eos: int, batch: int, steps: int) -> dict:
    words = (lib.vocab + 31) // 32
    row = np.zeros(words, dtype=np.int32)
    compile_ms, mask_us, first_mask_us = [], [], []
    for (schema, _), doc in zip(SCHEMAS, docs, strict=True):
        t0 = time.perf_counter()
        m = lib.compile(schema)
        compile_ms.append(1000 * (time.perf_counter() - t0))
        for i, token in enumerate(doc):
            t0 = time.perf_counter()
            lib.fill(m, row)
            dt = 1e6 * (time.perf_counter() - t0)
            (first_mask_us if i == 0 else mask_us).append(dt)
            assert allowed(row, token), f"{lib.name}: token {i} of a valid document was masked"
            lib.consume(m, token)
        assert lib.accepts_eos(m, eos, row), f"{lib.name}: EOS not allowed after a complete document"

    # A batch of `batch` requests, each at its own position in its document; one "step" = one mask per request.
    bitmask = np.zeros((batch, words), dtype=np.int32)
    matchers, cursors = [], []
    for j in range(batch):
        k = j % len(SCHEMAS)
        m = lib.compile(SCHEMAS[k][0])
        start = (j * 7) % max(1, len(docs[k]) - steps)
        for token in docs[k][:start]:
            lib.consume(m, token)
        matchers.append(m)
        cursors.append((k, start))
    serial_ms, par_ms = [], []
    for s in range(steps):
        # NOTE: one fill per state (serial on even steps, the thread pool on odd ones): a matcher may cache
        # the mask of its current state, so a second fill of the same state would be too cheap.
        t0 = time.perf_counter()
        if s % 2 == 0:
            for i, m in enumerate(matchers):
                lib.fill(m, bitmask[i])
            serial_ms.append(1000 * (time.perf_counter() - t0))
        else:
            lib.fill_batch(matchers, bitmask)
            par_ms.append(1000 * (time.perf_counter() - t0))
        for i, (k, start) in enumerate(cursors):  # advance every request by its next document token
            pos = start + s
            if pos < len(docs[k]):
                assert allowed(bitmask[i], docs[k][pos])
                lib.consume(matchers[i], docs[k][pos])
    return {
        "setup_s": round(lib.setup_s, 3),
        "compile_ms_mean": round(statistics.mean(compile_ms), 2),
        "compile_ms_max": round(max(compile_ms), 2),
        "first_mask_us_mean": round(statistics.mean(first_mask_us), 1),
        "mask_us_mean": round(statistics.mean(mask_us), 1),
        "mask_us_p50": round(pct(mask_us, 50), 1),
        "mask_us_p99": round(pct(mask_us, 99), 1),
        "num_masks": len(mask_us),
        f"batch{batch}_serial_ms_mean": round(statistics.mean(serial_ms), 2),
        f"batch{batch}_serial_ms_max": round(max(serial_ms), 2),
        f"batch{batch}_parallel_ms_mean": round(statistics.mean(par_ms), 2),
        f"batch{batch}_parallel_ms_max": round(max(par_ms), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128000, help="BPE merges target (plus 256 special tokens)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--libs", default="llguidance,xgrammar")
    ap.add_argument("--tokenizer-file", help="a tokenizer.json written by an earlier run (skips training)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    hf_tok = build_tokenizer(args.vocab, path=args.tokenizer_file)
    eos = hf_tok.eos_token_id
    docs = [hf_tok.encode(compact(inst), add_special_tokens=False) for _, inst in SCHEMAS]
    import torch

    report = {
        "vocab_size": len(hf_tok),
        "doc_tokens": [len(d) for d in docs],
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "results": {},
        "installed_mib": {d: installed_mib(d) for d in ("llguidance", "xgrammar", "apache-tvm-ffi")},
    }
    classes = {"llguidance": LLG, "xgrammar": XGR}
    for name in args.libs.split(","):
        lib = classes[name](hf_tok, args.threads)
        report["results"][name] = bench_library(lib, docs, eos, args.batch, args.steps)
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
