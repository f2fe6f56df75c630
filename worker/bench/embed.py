"""`cbq bench embed`: W7, bulk embedding, through cbq's embedding engine and sentence-transformers' `encode`.

W7 = N inputs (default 100,000) of 50-500 tokens, random token ids (seeded), on a model shape built from its
config with random weights: the Qwen3-Embedding-8B shape (a decoder, last-token pooling) or the BERT-large shape
(bge-large's: an encoder, CLS pooling), or tiny versions of both for the CPU. Each input is spelled as text that a
word-level tokenizer (built here, one word per token id) turns back into exactly its ids, so both sides tokenize the
same strings: cbq's engine (tokenization included, inputs fed as the worker feeds them, `has_capacity` and all)
and `SentenceTransformer.encode(batch_size=256)` on the same module in the same process (its weights are shared,
not loaded twice). Prints a table (inputs/s, tokens/s, the ratio) and writes JSON; the two outputs' cosine over
the first inputs is reported too.

On both shapes cbq's engine runs its packed forward by default (worker/embedding/packed.py on the decoder,
packed_encoder.py on BERT); the same engine with
transformers' padded forward (`decoder="hf"`, the engine before the packed forward) then runs the first
`--hf-forward-num` inputs on the same weights, so one run reports the packed forward's gain ("packed/hf") as well.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from worker.bench.common import run_header

WORKLOAD_W7 = {"num": 100_000, "min_len": 50, "max_len": 500}
NUM_CHECKED = 256  # inputs whose two embeddings are compared
# name -> (model_type, config fields, pooling): random weights, built from the config in code
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3-embedding-8b": (
        "qwen3",
        dict(vocab_size=151_665, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False),
        "lasttoken",
    ),
    "bert-large": (
        "bert",
        dict(vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
             num_attention_heads=16, max_position_embeddings=512, type_vocab_size=2),
        "cls",
    ),
    "tiny-qwen3": (
        "qwen3",
        dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True),
        "lasttoken",
    ),
    "tiny-bert": (
        "bert",
        dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, type_vocab_size=2),
        "cls",
    ),
}
_SPECIALS = {"qwen3": (["<|endoftext|>"], "$A <|endoftext|>", "<|endoftext|>"),
             "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]", "[PAD]")}


def w7_inputs(num: int, vocab_size: int, num_specials: int, seed: int = 0) -> list[str]:
    """`num` texts of 50-500 tokens each once tokenized (the specials the tokenizer adds included): random
    words `w{id}`, ids above the special tokens."""
    rng = random.Random(seed)
    first = len(_SPECIALS["bert"][0]) + 1  # above every special token of either tokenizer
    texts = []
    for _ in range(num):
        length = rng.randint(WORKLOAD_W7["min_len"], WORKLOAD_W7["max_len"]) - num_specials
        texts.append(" ".join(f"w{rng.randrange(first, vocab_size)}" for _ in range(length)))
    return texts


def _write_tokenizer(folder: Path, model_type: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials, template, pad = _SPECIALS[model_type]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1] if model_type == "bert" else specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in template.split() if t != "$A"]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, model_input_names=["input_ids", "attention_mask"], model_max_length=512
    ).save_pretrained(folder)


def build_shape(shape: str, device: Any, dtype: Any, folder: Path):
    """The random-weight base model of `shape` on `device`, its config and tokenizer written to `folder` (no
    weights: they are never written or read)."""
    import torch
    from transformers import AutoConfig, AutoModel

    model_type, fields, _ = SHAPES[shape]
    pad_id = 0
    config = AutoConfig.for_model(model_type, pad_token_id=pad_id, **fields)
    config.save_pretrained(folder)
    _write_tokenizer(folder, model_type, fields["vocab_size"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype)
    return model.eval()


def run_cbq(engine, texts: list[str], chunk: int = 1024) -> tuple[float, list[list[float]]]:
    """Seconds to embed `texts` through the engine as a worker feeds it (tokenized in chunks, added while it has
    capacity, results collected as they come); the first NUM_CHECKED inputs' embeddings."""
    from worker.embedding.engine import EmbeddingRequest

    backend = engine.tokenizer.backend
    checked: dict[int, list[float]] = {}
    num_done = 0
    start = time.perf_counter()
    engine.start()
    try:
        for first in range(0, len(texts), chunk):
            ids = backend(texts[first : first + chunk], add_special_tokens=True)["input_ids"]
            for offset, prompt_ids in enumerate(ids):
                engine.add_request(EmbeddingRequest(str(first + offset), prompt_ids))
            while not engine.has_capacity():
                num_done += _collect(engine, checked, timeout=0.05)
        while num_done < len(texts):
            num_done += _collect(engine, checked, timeout=1.0)
    finally:
        engine.shutdown()
    return time.perf_counter() - start, [checked[i] for i in range(min(NUM_CHECKED, len(texts)))]


def _collect(engine, checked: dict[int, list[float]], timeout: float) -> int:
    results = engine.get_results(timeout=timeout)
    for result in results:
        if result.finish_reason.value != "stop":
            raise click.ClickException(f"input {result.request_id} failed: {result.error}")
        index = int(result.request_id)
        if index < NUM_CHECKED:
            checked[index] = result.embedding
    return len(results)


def sentence_transformer(model, folder: Path, pooling: str, device: str):
    """sentence-transformers' pipeline (Transformer -> Pooling -> Normalize) around the already built `model`:
    only its weight loading is replaced, encode runs as released."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    class Prebuilt(Transformer):
        def _load_model(self, *args: Any, **kwargs: Any):
            return model

    transformer = Prebuilt(str(folder), max_seq_length=512)
    modules = [transformer, Pooling(model.config.hidden_size, pooling_mode=pooling), Normalize()]
    return SentenceTransformer(modules=modules, device=device)


@click.command("embed")
@click.option("--workload", type=click.Choice(["W7"]), default="W7", show_default=True)
@click.option("--num", type=int, default=WORKLOAD_W7["num"], show_default=True, help="Inputs in the workload.")
@click.option("--shape", "shapes", type=click.Choice(list(SHAPES)), multiple=True, default=["qwen3-embedding-8b"],
              show_default=True, help="Model shapes to run, one after the other (repeat the flag).")
@click.option("--reference-num", type=int, default=None,
              help="Run sentence-transformers on the first N inputs only (its rate is compared); default: all.")
@click.option("--no-reference", is_flag=True, help="Skip sentence-transformers.")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="cbq's tokens per batch (padded ones included in transformers' forward).")
@click.option("--decoder", type=click.Choice(["auto", "owned", "hf"]), default="auto", show_default=True,
              help="cbq's forward: auto = packed where it runs the model (decoder shapes, BERT), else transformers' "
                   "padded one; hf = transformers' padded one.")
@click.option("--hf-forward-num", type=int, default=None,
              help="Where cbq runs packed, also run it with transformers' padded forward on the first N inputs "
                   "(default: --reference-num, else all; 0 skips it).")
@click.option("--max-num-seqs", type=int, default=None, help="cbq's inputs per batch.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto: bf16 on CUDA, fp32 on the CPU.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default="embed_bench.json", show_default=True)
def embed_bench(workload, num, shapes, reference_num, no_reference, max_num_batched_tokens, decoder, hf_forward_num,
                max_num_seqs, device, dtype, seed, json_out):
    """W7 (bulk embedding) through cbq's embedding engine vs sentence-transformers' encode(batch_size=256)."""
    import torch

    from worker.embedding.checkpoint import EmbeddingSpec
    from worker.embedding.engine import PACKED, EmbeddingEngine
    from worker.engine.models.loader import resolve_device, resolve_dtype
    from worker.engine.tokenizer import HFTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    rows = []
    for shape in shapes:
        model_type, fields, pooling = SHAPES[shape]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model = build_shape(shape, torch_device, torch_dtype, folder)
            num_specials = 1 if model_type == "qwen3" else 2
            texts = w7_inputs(num, fields["vocab_size"], num_specials, seed)
            num_tokens = sum(len(t.split()) + num_specials for t in texts)
            from transformers import AutoTokenizer

            spec = EmbeddingSpec(folder, model_type, pooling, True, fields["hidden_size"], 512, "", False)  # type: ignore[arg-type]
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(folder))

            def cbq_engine(forward_choice: str, tokenizer=tokenizer, spec=spec, model=model) -> EmbeddingEngine:
                return EmbeddingEngine(
                    model, tokenizer, spec, 0, torch_device, max_batch_tokens=max_num_batched_tokens,
                    decoder=forward_choice, **({"max_batch_size": max_num_seqs} if max_num_seqs else {}),
                )

            engine = cbq_engine(decoder)
            cbq = _timed_cbq(engine, texts, num_specials)
            row: dict[str, Any] = {
                "workload": workload, "shape": shape, "num_inputs": num, "num_tokens": num_tokens,
                "device": str(torch_device), "dtype": str(torch_dtype).removeprefix("torch."), "cbq": cbq,
            }
            cbq_checked = cbq.pop("checked")
            hf_num = hf_forward_num if hf_forward_num is not None else (reference_num or num)
            if engine.forward == PACKED and hf_num > 0:  # the same engine and weights, transformers' padded forward
                hf_row = _timed_cbq(cbq_engine("hf"), texts[:hf_num], num_specials)
                hf_checked = hf_row.pop("checked")
                row["cbq_hf_forward"] = hf_row
                row["packed_over_hf"] = cbq["inputs_per_s"] / hf_row["inputs_per_s"]
                cosine = torch.nn.functional.cosine_similarity(
                    torch.tensor(cbq_checked[: len(hf_checked)]), torch.tensor(hf_checked), dim=-1
                )
                row["min_cosine_packed_vs_hf"] = cosine.min().item()
            if not no_reference:
                st = sentence_transformer(model, folder, pooling, str(torch_device))
                ref_texts = texts[: reference_num or num]
                ref_tokens = sum(len(t.split()) + num_specials for t in ref_texts)
                st.encode(ref_texts[:512], batch_size=256)  # the same warm-up
                if torch_device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                ref = st.encode(ref_texts, batch_size=256, convert_to_tensor=True)
                if torch_device.type == "cuda":
                    torch.cuda.synchronize()
                st_seconds = time.perf_counter() - start
                got = torch.tensor(cbq_checked)
                want = ref[: len(cbq_checked)].float().cpu()
                cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
                row["sentence_transformers"] = {
                    "num_inputs": len(ref_texts), "seconds": st_seconds, "inputs_per_s": len(ref_texts) / st_seconds,
                    "tokens_per_s": ref_tokens / st_seconds, "batch_size": 256,
                }
                row["ratio"] = row["cbq"]["inputs_per_s"] / row["sentence_transformers"]["inputs_per_s"]
                row["min_cosine_first_inputs"] = cosine.min().item()
                del st, ref
            rows.append(row)
            del engine, model
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
    _print_table(rows)
    report = {**run_header(), "rows": rows}
    Path(json_out).write_text(json.dumps(report, indent=2))
    click.echo(f"wrote {json_out}")


def _timed_cbq(engine, texts: list[str], num_specials: int) -> dict[str, Any]:
    """One cbq run of `texts` after a warm-up: its rates, batches, settings and (under "checked") the first
    NUM_CHECKED inputs' embeddings."""
    num_tokens = sum(len(t.split()) + num_specials for t in texts)
    run_cbq(engine, texts[: min(len(texts), 512)])  # warm-up: kernels chosen, allocator grown
    before = engine.stats()
    seconds, checked = run_cbq(engine, texts)
    after = engine.stats()
    return {"forward": engine.forward, "num_inputs": len(texts), "seconds": seconds,
            "inputs_per_s": len(texts) / seconds, "tokens_per_s": num_tokens / seconds,
            "batches": after.steps - before.steps, "busy_seconds": after.busy_seconds - before.busy_seconds,
            "max_batch_tokens": engine.max_batch_tokens, "max_batch_size": engine.max_batch_size, "checked": checked}


def _print_table(rows: list[dict[str, Any]]) -> None:
    click.echo(f"{'shape':<20} {'inputs':>8} {'cbq in/s':>10} {'cbq tok/s':>11} {'st in/s':>10} {'st tok/s':>11} "
               f"{'ratio':>6} {'min cos':>8} {'packed/hf':>9}")
    for row in rows:
        st = row.get("sentence_transformers")
        st_cols = f"{st['inputs_per_s']:>10.1f} {st['tokens_per_s']:>11.0f} {row['ratio']:>6.2f} " \
                  f"{row['min_cosine_first_inputs']:>8.5f}" if st else f"{'-':>10} {'-':>11} {'-':>6} {'-':>8}"
        gain = f"{row['packed_over_hf']:>9.2f}" if "packed_over_hf" in row else f"{'-':>9}"
        click.echo(f"{row['shape']:<20} {row['num_inputs']:>8} {row['cbq']['inputs_per_s']:>10.1f} "
                   f"{row['cbq']['tokens_per_s']:>11.0f} {st_cols} {gain}")
