"""Merge the JSON files that `benchmarks/run_gpu.sh` writes into `benchmarks/results.json`.

python3 benchmarks/collect_results.py DIR [DIR ...]
    # each DIR may hold w1.json, w1_hf.json, w2.json, w2_hf.json, w2_queue.json, w1_nocache.json,
    # w3_on.json, w3_off.json, w4_on.json, w4_off.json, w2_grammar.json, w2_deterministic.json,
    # w1_deterministic.json, w1_families.json, w2_families.json, w1_fp8.json, w2_fp8.json, w1_int4.json, w2_int4.json, fp8_quality.json,
    # w1_fp8_step.json, w1_moe_fp8.json, w5.json, w1_trace_results.json, tp1_w1_*.json, tp1_w2_*.json (with tp1.log),
    # w1_mla.json, w2_mla.json, w1_mla_owned.json, w6_qwen2_5_vl_7b.json, w7_qwen3_embedding_8b.json, w7_bert_large.json,
    # notes.json; a file in a later DIR replaces
    # the same file of an earlier one, and every entry carries the date of the run it came from
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FIELDS = (
    "output_tok_s",
    "total_tok_s",
    "gpu_busy",
    "floor_ratio",
    "floor_tok_s",
    "serial_floor_ratio",
    "step_ms",
    "gpu_ms",
    "cpu_prep_ms",
    "steps",
    "output_tokens",
    "wall_seconds",
    "num_preemptions",
)
COMMANDS = {
    "W1": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode both --max-num-seqs 32 --max-num-batched-tokens 2048 "
    "--decode-gemm cublas --decode-gemm triton --compare-hf --hf-output-len 128",
    "W1_hf": "the W1 command's --compare-hf (earlier runs: a separate --mode async run with --compare-hf --hf-output-len 128)",
    "W2": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode both --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192",
    "W2_hf": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --compare-hf --hf-num-requests 200 --hf-output-len 256",
    "W1_nocache": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --no-prefix-caching",
    "W3": "python3 -m worker.bench engine --model llama3-8b --workload W3 --mode async [--no-prefix-caching]",
    "W4": "python3 -m worker.bench engine --model llama3-8b --workload W4 --mode async [--no-prefix-caching]",
    "W2_queue": "python3 -m worker.bench e2e --model llama3-8b --workload W2 --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192",
    "W2_constrained": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --variant plain --variant json --variant logprobs5",
    # issue 25: mixtures of experts (random bf16 weights; floors count the experts each step's tokens hit)
    "W1_moe": "python3 -m worker.bench engine --model qwen3-30b-a3b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048",
    "W2_moe": "python3 -m worker.bench engine --model qwen3-30b-a3b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192",
    "W1_gptoss": "python3 -m worker.bench engine --model gptoss-20b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048",
    "W2_gptoss": "python3 -m worker.bench engine --model gptoss-20b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192",
    # GLM-4.5-Air's layer shape (grouped sigmoid routing, a shared expert), its first 23 layers: one H200 holds them
    "W1_glm45air": "python3 -m worker.bench engine --model glm45-air-23l --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048",
    "W2_glm45air": "python3 -m worker.bench engine --model glm45-air-23l --workload W2 --mode async "
    "--max-num-seqs 1024 --max-num-batched-tokens 8192",
    "W2_deterministic": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --deterministic",
    "W1_deterministic": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --deterministic",
    # issue 26: FP8 weights and KV (--quantization fp8 --kv-cache-dtype fp8) vs bf16, one process, async
    "W1_fp8": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --precision bf16 --precision fp8",
    "W2_fp8": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --precision bf16 --precision fp8",
    # issue 46: W4A16, every linear but the LM head rounded to INT4 (group 128, symmetric) and kept packed, vs bf16
    "W1_int4": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --precision bf16 --precision int4",
    "W2_int4": "python3 -m worker.bench engine --model llama3-8b --workload W2 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --precision bf16 --precision int4",
    "W1_fp8_step": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode async --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --precision fp8 --decode-gemm cublas --decode-gemm triton",
    "TP1_W1": "bash benchmarks/run_gpu.sh tp1w1 (W1 async, --max-num-seqs 32 --max-num-batched-tokens 2048, on the trees "
    "of 3b6bd23^ and 390d273, four processes: before, after, before, after)",
    "TP1_W2": "bash benchmarks/run_gpu.sh tp1w2 (W2 async, --max-num-seqs 1024 --max-num-batched-tokens 8192, likewise)",
    "FP8_quality": "python3 -m worker.bench quality --model llama3-8b --num-prompts 4 --prompt-len 512 --decode-len 32",
    # issue 49: MLPerf-shaped offline (W5), bf16 and FP8 weights + KV in one process; W1's step timeline
    "W5_bf16": "python3 -m worker.bench engine --model llama3-8b --workload W5 --mode async --max-num-seqs 1024 "
    "--max-num-batched-tokens 8192 --precision bf16 --precision fp8",
    "W5_fp8": "the W5_bf16 command (one process: bf16, then FP8 weights and KV)",
    "W1_trace": "python3 -m worker.bench engine --model llama3-8b --workload W1 --mode both --max-num-seqs 32 "
    "--max-num-batched-tokens 2048 --trace w1_trace.json",
}
# issue 24: the Gemma 3 12B and Phi-4 14B shapes, each against Llama-3-8B run in the same process
FAMILIES = "--model llama3-8b --model gemma3-12b --model phi4-14b --mode async --max-model-len 8192"
COMMANDS.update({
    "W1_families": f"python3 -m worker.bench engine {FAMILIES} --workload W1 --max-num-seqs 32 --max-num-batched-tokens 2048",
    "W2_families": f"python3 -m worker.bench engine {FAMILIES} --workload W2 --max-num-seqs 1024 --max-num-batched-tokens 8192",
})
FAMILY_RUNS = {"gemma3": "gemma3-12b", "phi4": "phi4-14b"}  # entry suffix -> preset; the reference is llama3-8b


# issue 47: the latent-attention shapes, each against Llama-3-8B in the same process (run_gpu.sh w1mla / w2mla)
MLA = "--model llama3-8b --model deepseek-v2-lite --model moonlight-16b-a3b --mode async --max-model-len 8192"
COMMANDS.update({
    "W1_mla": f"python3 -m worker.bench engine {MLA} --workload W1 --max-num-seqs 32 --max-num-batched-tokens 2048",
    "W2_mla": f"python3 -m worker.bench engine {MLA} --workload W2 --max-num-seqs 1024 --max-num-batched-tokens 8192",
    "W6": "python3 -m worker.bench vision --shape qwen2.5-vl-7b --num N --output-len 256 --hf-num-requests M --mode async",
    "W7": "python3 -m worker.bench embed --shape qwen3-embedding-8b --num N --reference-num M",
})
MLA_RUNS = {"deepseek_v2_lite": "deepseek-v2-lite", "moonlight": "moonlight-16b-a3b"}
# issue 47 item 5: DeepSeek-V2-Lite's W1 on transformers' layers with the latent attention ("auto") and on the owned
# decoder, in one process (run_gpu.sh w1mlaowned): {auto, owned, owned_over_auto}
MLA_OWNED_RUN = ("W1_mla_owned", "w1_mla_owned.json")
COMMANDS[MLA_OWNED_RUN[0]] = (
    "python3 -m worker.bench engine --model deepseek-v2-lite --decoder auto --decoder owned --workload W1 --mode async "
    "--max-num-seqs 32 --max-num-batched-tokens 2048 --max-model-len 8192"
)
# issues 50 and 48: `bench vision` / `bench embed` write rows of their own; the entry is the file's row
ROW_RUNS = {"W6": "w6_qwen2_5_vl_7b.json", "W7": "w7_qwen3_embedding_8b.json", "W7_bert": "w7_bert_large.json"}


def row_entry(run: dict) -> dict:
    """A `bench vision` or `bench embed` run's one row, with its command, date and GPU."""
    entry = dict(run["rows"][0])
    entry.update(command=run.get("command"), date=run.get("date"), device=run.get("gpu"))
    return entry


def family_entries(workload: str, run: dict, runs: dict[str, str] = FAMILY_RUNS) -> dict:
    """`W1_gemma3`, `W1_phi4`, ... from one several-model `bench engine` run: each model's async numbers, the
    Llama-3-8B run of the same process, and the floor ratio over Llama's (issue 24 asks within 10%). `runs`: entry
    suffix -> preset (MLA_RUNS for issue 47's shapes)."""
    by_model = {r["extra"].get("model"): r for r in run["results"].values()}
    llama = by_model.get("llama3-8b")
    out = {}
    for suffix, preset in runs.items():
        r = by_model.get(preset)
        if r is None:
            continue
        entry: dict = {"model": preset, "async": {f: r.get(f) for f in FIELDS}}
        entry["triton_compiles_in_measured_run"] = len(r["extra"].get("triton_compiles", []))
        if llama:
            entry["llama3_8b_same_call"] = {f: llama.get(f) for f in FIELDS}
            entry["floor_ratio_over_llama3_8b"] = r["floor_ratio"] / llama["floor_ratio"]
        entry["config"], entry["date"] = run["config"], run["date"]
        out[f"{workload}_{suffix}"] = entry
    return out


TP1_RUNS = ("TP1_W1", "TP1_W2")  # issue 27 item 6: TP=1 before / after tensor parallelism's wiring (run_gpu.sh tp1w1)


def tp1_entry(src: Path, workload: str) -> dict | None:
    """`run_gpu.sh tp1w1` / `tp1w2`: four runs, before / after / before / after, each in its own process. A run's
    JSON is read where it came back; the device brings back at most 8 files a call, so for one that did not, the
    row `bench engine` printed above its `wrote ...json` line in tp1.log gives its output tok/s and floor ratio."""
    runs: dict[str, dict] = {}
    for f in sorted(src.glob(f"tp1_{workload}_*.json")):
        r = json.loads(f.read_text())
        runs[f.stem] = {"output_tok_s": r["results"]["async"]["output_tok_s"],
                        "floor_ratio": r["results"]["async"]["floor_ratio"], "source": f.name, "date": r["date"]}
    log = src / "tp1.log"
    if log.exists():
        row = None
        for line in log.read_text().splitlines():
            if line.strip().startswith("async |"):
                row = [c.strip() for c in line.split("|")]
            written = re.search(rf"wrote \S*/(tp1_{workload}_\w+)\.json", line)
            if written and row and written.group(1) not in runs:
                runs[written.group(1)] = {"output_tok_s": float(row[1].replace(",", "")), "floor_ratio": float(row[10]),
                                          "source": "tp1.log"}
    if not runs:
        return None
    by_tree = {t: [r["output_tok_s"] for n, r in sorted(runs.items()) if f"_{t}_" in n] for t in ("before", "after")}
    entry: dict = {"runs": dict(sorted(runs.items(), key=lambda kv: kv[0].rsplit("_", 1)[1]))}
    if all(by_tree.values()):
        entry["after_over_before"] = (sum(by_tree["after"]) / len(by_tree["after"])) / (sum(by_tree["before"]) / len(by_tree["before"]))
    return entry


FP8_RUNS = {"W1_fp8": "w1_fp8.json", "W2_fp8": "w2_fp8.json", "W1_moe_fp8": "w1_moe_fp8.json"}  # W1_moe_fp8: Qwen3-30B-A3B shape
INT4_RUNS = {"W1_int4": "w1_int4.json", "W2_int4": "w2_int4.json"}  # issue 46: W4A16 (packed INT4 weights) vs bf16
PRECISION_RUNS = {**FP8_RUNS, **INT4_RUNS}  # each `bench engine --precision bf16 --precision P` in one process
FP8_STEP_RUN = ("W1_fp8_step", "w1_fp8_step.json")  # FP8 small-step GEMMs (decode_gemm triton) vs cublas
MOE_RUNS = {
    "W1_moe": "w1_moe.json",
    "W2_moe": "w2_moe.json",
    "W1_gptoss": "w1_gptoss.json",
    "W2_gptoss": "w2_gptoss.json",
    "W1_glm45air": "w1_glm45air.json",
    "W2_glm45air": "w2_glm45air.json",
}


OFFLINE_RUN = ("W5", "w5.json")  # issue 49: W5 at bf16 and FP8 in one process -> W5_bf16, W5_fp8
TRACE_RUN = ("W1_trace", "w1_trace_results.json")  # issue 49 item 3: W1 sync and async with --trace


def offline_entries(name: str, run: dict) -> dict:
    """`bench engine --workload W5 --precision bf16 --precision fp8`: `W5_bf16` and `W5_fp8`, each with its runs by
    mode (every field, total tok/s included: W5 is prefill-bound), the workload's measured lengths, and in
    `W5_fp8` the ratio over bf16 of the same process."""
    out: dict = {}
    for mode, r in run["results"].items():
        precision = r["extra"].get("precision") or "bf16"
        entry = out.setdefault(f"{name}_{precision}", {})
        entry[mode.split("-")[0]] = {f: r.get(f) for f in FIELDS}
        entry.setdefault("triton_compiles_in_measured_run", {})[mode] = len(r["extra"].get("triton_compiles", []))
    for entry in out.values():
        entry.update(workload=run.get("workload_stats"), config=run["config"], date=run["date"])
    bf16, fp8 = out.get(f"{name}_bf16", {}).get("async"), out.get(f"{name}_fp8", {}).get("async")
    if bf16 and fp8:
        out[f"{name}_fp8"]["fp8_over_bf16"] = fp8["output_tok_s"] / bf16["output_tok_s"]
    return out


def trace_entry(run: dict) -> dict:
    """`bench engine --trace`: each mode's device busy fraction from its trace (and the engine's own), the files."""
    entry: dict = {
        mode: {"trace_device_busy": r["extra"].get("trace", {}).get("device_busy"), "gpu_busy": r["gpu_busy"],
               "output_tok_s": r["output_tok_s"], "steps": r["steps"]}
        for mode, r in run["results"].items()
    }  # fmt: skip
    trace = run.get("trace") or ""
    entry.update(trace=Path(trace).name, png=Path(trace).with_suffix(".png").name, date=run["date"])
    return entry


def determinism_entry(run: dict) -> dict:
    """`bench engine --deterministic`'s two async runs: {deterministic, default, deterministic_over_default}."""
    by_kind = {
        "deterministic" if r["extra"].get("deterministic") else "default": r
        for mode, r in run["results"].items()
        if mode.startswith("async")
    }
    entry: dict = {k: {f: r.get(f) for f in FIELDS} for k, r in by_kind.items()}
    if len(by_kind) == 2:
        entry["deterministic_over_default"] = (
            by_kind["deterministic"]["output_tok_s"] / by_kind["default"]["output_tok_s"]
        )
    entry["config"], entry["date"] = run["config"], run["date"]
    return entry


def precision_entry(run: dict) -> dict:
    """`bench engine --precision bf16 --precision P`'s async runs: {P, bf16, P_over_bf16} (P fp8 or int4). Each
    floor_ratio is against its own floor: the fp8 run's reads weights and KV at 1 byte and computes at the FP8
    tensor-core rate; the int4 run's reads its linears' weights at half a byte plus their group scales."""
    by_precision = {
        r["extra"]["precision"]: r for mode, r in run["results"].items() if mode.startswith("async") and r["extra"].get("precision")
    }
    entry: dict = {p: {f: r.get(f) for f in FIELDS} for p, r in by_precision.items()}
    for p, r in by_precision.items():  # fp8_over_bf16, int4_over_bf16
        if p != "bf16" and "bf16" in by_precision:
            entry[f"{p}_over_bf16"] = r["output_tok_s"] / by_precision["bf16"]["output_tok_s"]
    entry["config"], entry["date"] = run["config"], run["date"]
    return entry


def setup_entry(run: dict, base: str, other: str) -> dict:
    """A `bench engine` run of two setups of one option in one process, e.g. `--decode-gemm cublas --decode-gemm
    triton` or `--decoder auto --decoder owned`, results named async-SETUP: {base, other, other_over_base}."""
    by_setup = {mode.split("-", 1)[1]: r for mode, r in run["results"].items() if mode.startswith("async-")}
    entry: dict = {g: {f: r.get(f) for f in FIELDS} for g, r in by_setup.items()}
    if base in by_setup and other in by_setup:
        entry[f"{other}_over_{base}"] = by_setup[other]["output_tok_s"] / by_setup[base]["output_tok_s"]
    entry["config"], entry["date"] = run["config"], run["date"]
    return entry


def main(srcs: list[Path]) -> dict:
    def load(name):
        found = [src / name for src in srcs if (src / name).exists()]
        return json.loads(found[-1].read_text()) if found else None

    w1, w1_hf, w2, w2_hf, queue = (
        load(n) for n in ("w1.json", "w1_hf.json", "w2.json", "w2_hf.json", "w2_queue.json")
    )
    determinism_runs = {n: load(f"{n.split('_')[0].lower()}_deterministic.json") for n in ("W2_deterministic", "W1_deterministic")}
    family_runs = {w: load(f"{w.lower()}_families.json") for w in ("W1", "W2")}
    fp8_runs = {name: load(file) for name, file in PRECISION_RUNS.items()}  # FP8 and INT4 weights vs bf16
    fp8_step = load(FP8_STEP_RUN[1])
    offline, traced = load(OFFLINE_RUN[1]), load(TRACE_RUN[1])
    mla_runs = {w: load(f"{w.lower()}_mla.json") for w in ("W1", "W2")}
    mla_owned = load(MLA_OWNED_RUN[1])
    row_runs = {name: load(file) for name, file in ROW_RUNS.items()}
    first = (
        w1 or w2 or determinism_runs["W2_deterministic"] or determinism_runs["W1_deterministic"]
        or family_runs["W1"] or family_runs["W2"] or fp8_runs["W1_fp8"] or fp8_runs["W2_fp8"] or fp8_step
        or fp8_runs["W1_int4"] or fp8_runs["W2_int4"]
        or offline or traced or mla_runs["W1"] or mla_runs["W2"] or mla_owned
    )  # fmt: skip
    if first is None:
        rows = [r for r in row_runs.values() if r]
        if not rows:
            return {}
        first = {"device": rows[0]["gpu"], "torch": rows[0]["torch"], "date": rows[0].get("date"),
                 "copy_bandwidth_bytes_s": None}  # fmt: skip
    out = {
        "device": first["device"],
        "torch": first["torch"],
        "date": max(
            r["date"]
            for r in (w1, w2, *determinism_runs.values(), *family_runs.values(), *fp8_runs.values(), fp8_step, offline, traced,
                      *mla_runs.values(), mla_owned, first)
            if r and r.get("date")
        ),  # of the newest run; each entry has its own
        "copy_bandwidth_bytes_s": first["copy_bandwidth_bytes_s"],
        "commands": COMMANDS,
        "note": "Whole-workload runs of cbq's engine (random-weight Llama-3-8B shape, bf16, EOS ignored). "
        "'hf' is transformers' generate_batch (paged|sdpa) on the same model and prompts in the same process, "
        "on the subset and output cap named in its entry (it is too slow for the full workload).",
    }
    for name, main_run, hf_run in (("W1", w1, w1_hf), ("W2", w2, w2_hf)):
        if not main_run:
            continue
        if "hf" in main_run["results"]:  # --compare-hf in the main run itself: same process, preferred
            hf_run = main_run
        entry = {mode: {k: r.get(k) for k in FIELDS} for mode, r in main_run["results"].items() if mode != "hf"}
        gemms = main_run["config"].get("decode_gemms", [])
        if len(gemms) > 1 and "triton" in gemms:  # an A/B of the small-step path: the default is triton's
            ab = {g: {m: entry.pop(f"{m}-{g}") for m in ("sync", "async") if f"{m}-{g}" in entry} for g in gemms}
            entry.update(ab.pop("triton"))
            entry["decode_gemm_ab"] = ab
            if "async" in entry and "async" in ab.get("cublas", {}):
                entry["triton_over_cublas_async"] = entry["async"]["output_tok_s"] / ab["cublas"]["async"]["output_tok_s"]
        if "sync" in entry and "async" in entry:
            entry["async_over_sync"] = entry["async"]["output_tok_s"] / entry["sync"]["output_tok_s"]
        if hf_run and "hf" in hf_run["results"]:
            hf = hf_run["results"]["hf"]
            entry["hf"] = {k: hf[k] for k in ("output_tok_s", "total_tok_s", "output_tokens", "wall_seconds")}
            entry["hf"].update(gpu_busy=None, floor_ratio=None, step_ms=None, cpu_prep_ms=None, **hf["extra"])
            # against cbq's async run from the same process as transformers' (compare within one run)
            cbq = hf_run["results"].get("async") or hf_run["results"].get("async-triton") or entry["async"]
            entry["cbq_async_over_hf"] = cbq["output_tok_s"] / hf["output_tok_s"]
        entry["config"] = main_run["config"]
        entry["date"] = main_run["date"]
        out[name] = entry
    w1_nocache = load("w1_nocache.json")
    if w1_nocache and "W1" in out:
        out["W1"]["async_prefix_caching_off"] = {k: w1_nocache["results"]["async"].get(k) for k in FIELDS}
    for name in ("W3", "W4"):  # prefix caching on vs off (W4 off: its n samples sent as separate requests)
        on, off = load(f"{name.lower()}_on.json"), load(f"{name.lower()}_off.json")
        if on and off:
            runs = {"cache_on": on["results"]["async"], "cache_off": off["results"]["async"]}
            out[name] = {k: {f: r.get(f) for f in (*FIELDS, "prefix_cache_hit_rate")} for k, r in runs.items()}
            out[name]["on_over_off"] = runs["cache_on"]["output_tok_s"] / runs["cache_off"]["output_tok_s"]
            out[name]["date"] = on["date"]
    grammar = load("w2_grammar.json")  # issue 13: every request JSON-constrained / asking top_logprobs 5
    if grammar:
        runs = {r["extra"]["variant"]: r for r in grammar["results"].values()}
        entry = {v: {f: r.get(f) for f in (*FIELDS, "mask_ms")} for v, r in runs.items()}
        plain = runs["plain"]["output_tok_s"]
        entry.update({f"{v}_over_plain": r["output_tok_s"] / plain for v, r in runs.items() if v != "plain"})
        entry["date"] = grammar["date"]
        out["W2_constrained"] = entry
    for name, file in MOE_RUNS.items():  # issue 25: cbq's modes only, each with its MoE floor ratio
        moe = load(file)
        if moe:
            results = moe["results"]
            llama = None
            if len(moe.get("models", [])) > 1:  # Llama-3-8B run first in the same process (the issue's reference)
                model_of = {mode: r["extra"].get("model", "") for mode, r in results.items()}
                llama = next((r for mode, r in results.items() if model_of[mode] == "llama3-8b"), None)
                results = {
                    mode.removesuffix(f"-{model_of[mode]}"): r for mode, r in results.items() if model_of[mode] != "llama3-8b"
                }
            entry = {mode: {k: r.get(k) for k in FIELDS} for mode, r in results.items()}
            if llama is not None:
                entry["llama3_8b_same_call"] = {k: llama.get(k) for k in FIELDS}
            if "sync" in entry and "async" in entry:
                entry["async_over_sync"] = entry["async"]["output_tok_s"] / entry["sync"]["output_tok_s"]
            model = moe["model"] if isinstance(moe["model"], str) else [m for m in moe["model"] if m != "llama3-8b"][0]
            out[name] = {**entry, "model": model, "config": moe["config"], "date": moe["date"]}
    for workload, families in family_runs.items():  # issue 24
        if families:
            out.update(family_entries(workload, families))
    for workload, mla in mla_runs.items():  # issue 47
        if mla:
            out.update(family_entries(workload, mla, MLA_RUNS))
    if mla_owned:
        out[MLA_OWNED_RUN[0]] = setup_entry(mla_owned, "auto", "owned")
    for name, run in row_runs.items():  # issues 48 and 50
        if run:
            out[name] = row_entry(run)
    for name, run in determinism_runs.items():  # issue 32: the price of batch invariance
        if run:
            out[name] = determinism_entry(run)
    for name, run in fp8_runs.items():  # issues 26, 46: FP8 weights and KV, or INT4 weights, vs bf16 in one process
        if run:
            out[name] = precision_entry(run)
    if fp8_step:
        out[FP8_STEP_RUN[0]] = setup_entry(fp8_step, "cublas", "triton")
    if offline:
        out.update(offline_entries(OFFLINE_RUN[0], offline))
    if traced:
        out[TRACE_RUN[0]] = trace_entry(traced)
    quality = load("fp8_quality.json")  # issue 26: what FP8 costs in accuracy, next to what it gains
    if quality:
        out["FP8_quality"] = quality
    for src in srcs:  # notes.json: {entry: "what to know when reading it"}, from the folder of that run
        notes = src / "notes.json"
        for name, note in (json.loads(notes.read_text()) if notes.exists() else {}).items():
            if name in out:
                out[name]["note"] = note
    for name in TP1_RUNS:  # the newest folder holding that workload's runs
        for src in reversed(srcs):
            entry = tp1_entry(src, name.split("_")[1].lower())
            if entry:
                out[name] = {**entry, "command": COMMANDS[name]}
                break
    if queue:
        out["W2_through_redis"] = {
            "engine_only_tok_s": queue["engine_only"]["output_tok_s"],
            "through_redis_tok_s": queue["through_redis"]["output_tok_s"],
            "ratio": queue["ratio"],
        }
    return out


if __name__ == "__main__":
    srcs = [Path(a) for a in sys.argv[1:]] or [Path("benchmarks/h200")]
    result = main(srcs)
    if not result:
        sys.exit(f"no w1.json, w2.json, w*_deterministic.json, w*_fp8.json or w5.json in {', '.join(map(str, srcs))}: nothing to collect")
    Path("benchmarks/results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k in ("W1", "W2", "W3", "W4", "W2_through_redis", "W2_constrained", "W2_deterministic", *MOE_RUNS, *(f"{w}_{f}" for w in ("W1", "W2") for f in FAMILY_RUNS), *PRECISION_RUNS, *TP1_RUNS, "W5_bf16", "W5_fp8", TRACE_RUN[0])}, indent=1
        )[:3000]
    )
