"""`cbq bench engine`: a workload through the engine, sync vs async, vs transformers' own continuous batching.

Prints a table and writes JSON with every number, including the memory/compute floor of every step.
Variants run the same requests constrained to a small JSON schema and/or asking for top logprobs
(`--variant plain --variant json --variant logprobs5`), each in every mode, in one process; `--deterministic`
runs every setup in deterministic and in default mode (EngineConfig.deterministic), also in one process;
`--precision bf16 --precision fp8` runs the model in bf16 and with FP8 weights and KV (`--quantization fp8
--kv-cache-dtype fp8`), one model after the other, in one process (`--precision int4`: W4A16, the linears rounded
to INT4 at load and kept packed). `--trace FILE` writes a Perfetto/Chrome
timeline of every measured run's steps and a PNG of device busy over time (trace.py). Floors: floors.py; the
table, ratios and result fields: report.py; the workloads: common.py (W1, W2, W5) and cache_workloads.py (W3, W4).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from typing import Any

import click

from worker.bench.cache_workloads import CACHE_WORKLOADS, make_cache_workload
from worker.bench.common import (
    OFFLINE_WORKLOADS,
    WORKLOADS,
    compared_choice,
    eos_ignored,
    make_workload,
    triton_compiles,
    warmup_requests,
    with_variant,
    workload_stats,
)
from worker.bench.floors import engine_floors, measure_copy_bandwidth
from worker.bench.report import ModeResult, print_ratios, print_table, slowest_steps, tokens_digest
from worker.bench.trace import StepTracer, write_trace
from worker.cli_options import (
    deterministic_option,
    gpu_memory_options,
    quantization_options,
    tensor_parallel_option,
)
from worker.engine.config import DECODE_GEMMS, DECODERS, EngineConfig
from worker.engine.latent_prefill import MLA_PREFILL_CHOICES, MLA_PREFILL_ENV

ENGINE_DEFAULTS = EngineConfig()
# `--precision`: what each name sets (EngineConfig fields; the model loads with its quantization)
PRECISIONS: dict[str, dict[str, str | None]] = {
    "bf16": {"quantization": None, "kv_cache_dtype": "auto"},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "fp8-weights": {"quantization": "fp8", "kv_cache_dtype": "auto"},  # the two halves of "fp8", to tell them apart
    "fp8-kv": {"quantization": None, "kv_cache_dtype": "fp8"},
    "int4": {"quantization": None, "kv_cache_dtype": "auto"},  # W4A16: the weights are packed here (PACKED_INT4)
}
# `--precision` names whose model's linears are rounded to INT4 at load and kept packed (quant/int4/linear.py
# quantize_linears: round-to-nearest per output row and group, every linear but the output head), as (group size,
# symmetric). A bench-only precision: random-weight presets have no INT4 release to load.
PACKED_INT4: dict[str, tuple[int, bool]] = {"int4": (128, True)}


def run_engine_mode(engine, reqs, mode: str, bandwidth: float, tracer: StepTracer | None = None) -> ModeResult:
    """One measured run of `reqs` (`tracer`: its steps' spans are recorded, `--trace`)."""
    from worker.engine.kv_cache import kv_cache_dtype

    engine.reset_stats()
    with triton_compiles() as compiled:
        if tracer is not None:
            engine.trace_steps(tracer)
        t0 = time.perf_counter()
        try:
            results = engine.generate(reqs)
        finally:
            wall = time.perf_counter() - t0
            engine.trace_steps(None)
    if compiled:
        click.echo(
            f"warning: {len(compiled)} Triton compile(s) during the measured {mode} run "
            f"({', '.join(sorted(set(compiled)))}): its wall and device times include them",
            err=True,
        )
    stats = engine.stats()
    errors = [r for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0].error}")
    out_tokens = sum(len(s.token_ids) for r in results for s in r.all_samples)
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    floor, serial_floor = engine_floors(
        engine.model, engine.step_log, bandwidth, kv_cache_dtype(engine.config, engine.model.dtype)
    )
    steps = max(stats.steps, 1)
    return ModeResult(
        mode=mode,
        output_tokens=out_tokens,
        wall_seconds=wall,
        output_tok_s=out_tokens / wall,
        total_tok_s=(out_tokens + prompt_tokens) / wall,
        steps=stats.steps,
        step_ms=1000 * wall / steps,
        gpu_ms=1000 * stats.busy_seconds / steps,
        cpu_prep_ms=1000 * stats.cpu_prep_seconds / steps,
        mask_ms=1000 * stats.mask_seconds / steps,
        gpu_busy=min(1.0, stats.busy_seconds / wall),
        floor_seconds=floor,
        floor_ratio=floor / wall if floor else 0.0,
        floor_tok_s=out_tokens / floor if floor else 0.0,
        serial_floor_ratio=serial_floor / wall if serial_floor else 0.0,
        num_preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        extra={
            "triton_compiles": compiled,
            "slowest_steps": slowest_steps(engine.step_log),
            "tokens_digest": tokens_digest(results),
            # deterministic mode: whether its probe let attention's query tiles follow the step on this device
            "attention_tiles_by_step": getattr(engine.runner.attn_backend, "tiles_by_step", None),
        },
    )


def run_hf(model, reqs, output_len_cap: int | None) -> ModeResult:
    """transformers' own continuous batching (`generate_batch`) on the same model and prompts."""
    import torch
    from transformers import GenerationConfig

    max_new = max(r.sampling.max_new_tokens for r in reqs)
    if output_len_cap:
        max_new = min(max_new, output_len_cap)
    saved = model.config._attn_implementation
    model.set_attn_implementation("paged|sdpa")
    try:
        with eos_ignored(model):  # random weights: lengths are fixed by the workload, as for cbq
            gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            inputs = [r.prompt_ids for r in reqs]
            model.generate_batch(
                inputs=inputs[:2],
                generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0),
            )
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outputs = model.generate_batch(inputs=inputs, generation_config=gen)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        model.set_attn_implementation(saved)
    out_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    prompt_tokens = sum(len(i) for i in inputs)
    return ModeResult(
        mode="hf",
        output_tokens=out_tokens,
        wall_seconds=wall,
        output_tok_s=out_tokens / wall,
        total_tok_s=(out_tokens + prompt_tokens) / wall,
        extra={"max_new_tokens": max_new, "num_requests": len(reqs)},
    )


@click.command("engine")
@click.option(
    "--model",
    "models",
    multiple=True,
    default=("llama3-8b",),
    show_default=True,
    help="Preset name or checkpoint path (repeat to run several models one after another in one process, each "
    "loaded and freed in turn; results are then named MODE-...-MODEL).",
)
@click.option(
    "--workload",
    type=click.Choice([*WORKLOADS, *CACHE_WORKLOADS, *OFFLINE_WORKLOADS]),
    default="W1",
    show_default=True,
    help="W1, W2: uniform lengths; W3, W4: a shared prefix, n samples; W5: MLPerf-shaped offline "
    f"({OFFLINE_WORKLOADS['W5'].describe()}).",
)
@click.option("--num-requests", type=int, default=None, help="Override the workload's request count.")
@click.option(
    "--mode",
    type=click.Choice(["sync", "async", "both", "none"]),
    default="both",
    show_default=True,
    help="Engine modes to run; 'none' with --compare-hf runs transformers only.",
)
@click.option("--compare-hf", is_flag=True, help="Also run transformers' generate_batch on the same inputs.")
@click.option("--hf-output-len", type=int, default=None, help="Cap HF's new tokens (it is slow).")
@click.option("--hf-num-requests", type=int, default=None, help="Run HF on the first N requests only.")
@click.option("--max-num-seqs", type=int, default=ENGINE_DEFAULTS.max_num_seqs, show_default=True)
@click.option(
    "--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS.max_num_batched_tokens, show_default=True
)
@gpu_memory_options
@quantization_options
@deterministic_option
@tensor_parallel_option
@click.option("--no-cuda-graphs", is_flag=True)
@click.option(
    "--no-prefix-caching",
    is_flag=True,
    help="Compute every prompt whole; W4 sends its n samples as n requests.",
)
@compared_choice(
    "--decoder",
    "decoders",
    DECODERS,
    "Decoder(s) to run, each in every mode (repeat to compare; results are then named MODE-DECODER).",
)
@compared_choice(
    "--decode-gemm",
    "decode_gemms",
    DECODE_GEMMS,
    "Small-step GEMM path(s) of the owned decoder (EngineConfig.decode_gemm; repeat to compare in "
    "one process; results are then named MODE-...-GEMM).",
)
@compared_choice(
    "--mla-prefill",
    "mla_prefills",
    MLA_PREFILL_CHOICES,
    "Latent attention's prefill (CBQ_MLA_PREFILL, latent_prefill.py): absorbed, over expanded K/V, or each "
    "step's cheaper; repeat to compare in one process (results are then named MODE-...-PREFILL).",
)
@click.option(
    "--constrain-json", is_flag=True, help="Constrain every request to a small JSON schema (bench_json_schema)."
)
@click.option(
    "--top-logprobs", type=click.IntRange(0, 20), default=None, help="Every request asks for K top logprobs."
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    callback=lambda _ctx, _param, values: [parse_variant(v) for v in values],  # checked before the model loads
    help="Request variant(s) to run, each in every mode: plain, json, logprobsK or json+logprobsK "
    "(repeat to compare in one process; results are then named MODE-VARIANT). Default: the one "
    "--constrain-json and --top-logprobs give.",
)
@click.option(
    "--precision",
    "precisions",
    type=click.Choice(list(PRECISIONS)),
    multiple=True,
    help="bf16: the model as is; fp8: FP8 weights and KV cache (--quantization fp8 --kv-cache-dtype fp8); "
    "fp8-weights, fp8-kv: one of the two; int4: W4A16, every linear but the LM head rounded to INT4 (group 128, "
    "symmetric) and kept packed. Repeat to compare in one process (the models load one after the other); "
    "results are then named MODE-...-PRECISION. Overrides --quantization and --kv-cache-dtype.",
)
@click.option("--device", default=ENGINE_DEFAULTS.device, show_default=True)
@click.option("--dtype", default=ENGINE_DEFAULTS.dtype, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--trace",
    "trace_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a Perfetto/Chrome trace (JSON) of every measured run's steps (CPU preparation, H2D, compute, D2H "
    "and CPU wait; a process per run) to this file, and the device's busy fraction over time beside it (.png).",
)
def engine_bench(
    models,
    workload,
    num_requests,
    mode,
    compare_hf,
    hf_output_len,
    hf_num_requests,
    max_num_seqs,
    max_num_batched_tokens,
    engine_config,
    no_cuda_graphs,
    no_prefix_caching,
    decoders,
    decode_gemms,
    mla_prefills,
    constrain_json,
    top_logprobs,
    variants,
    precisions,
    device,
    dtype,
    json_out,
    trace_out,
):
    """Run a workload through the engine in sync and/or async mode and report throughput vs the floor."""
    import torch

    from worker.engine.engine import Engine
    from worker.engine.models import family_for, load_model, resolve_device, resolve_dtype
    from worker.engine.models.loader import check_moe_fit
    from worker.engine.moe.fp8_experts import expert_format_of
    from worker.engine.quant.int4.linear import quantize_linears
    from worker.engine.ranks import build_sharded_engine, sharded_model_config

    if len(precisions) > 1 and compare_hf:
        raise click.UsageError("--compare-hf runs one model: give at most one --precision with it")
    dev = resolve_device(device)
    # Tensor parallelism: each run's engine loads its own shards on every rank (no whole model here).
    is_sharded = engine_config.get("tensor_parallel_size", 1) > 1
    if is_sharded and any(p in PACKED_INT4 for p in precisions):
        raise click.UsageError("--precision int4 packs one process's model: not with --tensor-parallel-size")
    if is_sharded and compare_hf:
        raise click.ClickException("--compare-hf runs the whole model in one process: not with --tensor-parallel-size")
    modes = {"both": ["sync", "async"], "none": []}.get(mode, [mode])
    parsed = variants or [(constrain_json, top_logprobs)]
    results: list[ModeResult] = []
    traces: list[tuple[str, StepTracer]] = []  # --trace: each measured run's spans
    # --deterministic runs every setup twice in this process, deterministic then default (named MODE-...-
    # deterministic and MODE-...-default), so that the cost of the mode is measured on one warm device.
    determinisms = ["deterministic", "default"] if engine_config.pop("deterministic", False) else ["default"]
    runs = [  # every setup, run for each (model, precision) in turn
        (d, g, k, p, m, v)
        for d in decoders
        for g in decode_gemms
        for k in determinisms
        for p in mla_prefills
        for v in parsed
        for m in modes
    ]

    def setup_suffix(
        decoder: str, gemm: str, determinism: str, model: str = "", precision: str | None = None, prefill: str = ""
    ) -> str:
        """What names a run's engine setup in its label, where more than one was asked for."""
        return "".join(
            f"-{value}"
            for value, many in (
                (decoder, len(decoders) > 1),
                (gemm, len(decode_gemms) > 1),
                (determinism, len(determinisms) > 1),
                (model, len(models) > 1),
                (precision, len(precisions) > 1),
                (prefill, len(mla_prefills) > 1),
            )
            if many
        )

    bandwidth = 0.0
    load_seconds: dict[str, float] = {}
    for model in models:
        for precision in precisions or [None]:
            # one model at one precision in memory at a time: each (model, precision) is loaded, run, freed
            settings = PRECISIONS[precision] if precision else {}
            engine_config.update({k: v for k, v in settings.items() if v is not None})
            if precision and settings["quantization"] is None:
                engine_config.pop("quantization", None)
            free_bytes = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
            t0 = time.perf_counter()
            hf_model: Any = None
            tokenizer: Any = None
            if is_sharded:
                model_config = sharded_model_config(model)
            else:
                hf_model, tokenizer = load_model(
                    model, dev, resolve_dtype(dtype, dev), quantization=engine_config.get("quantization")
                )
                model_config = hf_model.config
                if precision in PACKED_INT4:
                    group_size, symmetric = PACKED_INT4[precision]
                    packed = quantize_linears(hf_model, group_size, symmetric)
                    click.echo(f"{model}: {packed} linears packed as INT4 (group {group_size})", err=True)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()  # the bf16 weights' blocks, before the engine sizes its KV cache
                if free_bytes and family_for(model_config)[0].moe is not None:  # the numbers the load checked
                    fp8_experts = expert_format_of(hf_model)
                    click.echo(check_moe_fit(model_config, hf_model.dtype, free_bytes, fp8_experts), err=True)
            load_seconds[model if precision is None else f"{model}-{precision}"] = time.perf_counter() - t0
            bandwidth = bandwidth or measure_copy_bandwidth(dev)
            vocab_limit = min(model_config.vocab_size, 32000)
            if workload in CACHE_WORKLOADS:
                reqs = make_cache_workload(workload, vocab_limit, not no_prefix_caching, num_requests=num_requests)
            else:
                reqs = make_workload(workload, vocab_limit, num_requests=num_requests)
            offline = OFFLINE_WORKLOADS.get(workload)
            if offline is not None:  # issue 49's method: warmed up by its first requests alone, at full length
                warmup = warmup_requests(reqs[: offline.num_warmup], vocab_limit, full_length=True)
            else:
                warmup = warmup_requests(reqs, vocab_limit)
            first_of_load = True
            for decoder, gemm, determinism, prefill, m, (is_json, num_top) in runs:
                os.environ[MLA_PREFILL_ENV] = prefill  # read at each step: this run's engine steps under it
                config = EngineConfig(
                    mode=m,
                    device=str(dev),
                    dtype=dtype,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    use_cuda_graphs=not no_cuda_graphs,
                    enable_prefix_caching=not no_prefix_caching,
                    decoder=decoder,
                    decode_gemm=gemm,
                    deterministic=determinism == "deterministic",
                    **engine_config,  # --gpu-memory-utilization, --max-model-len, --num-kv-blocks, --quantization
                )
                t1 = time.perf_counter()
                engine = build_sharded_engine(model, config) if is_sharded else Engine(hf_model, tokenizer, config)
                setup = time.perf_counter() - t1
                # Compile every kernel variant the workload needs (and the grammar's tokenizer for a constrained
                # run).
                engine.generate(with_variant(warmup, is_json, num_top))
                if first_of_load and dev.type == "cuda" and offline is None:
                    # NOTE: on the H200 a process's first measured run was up to ~19% slower on the device. The
                    # cause was a Triton compile inside a step (a prefill-kernel variant for a mixed step's counts,
                    # 1.4 s, which the step's device events count); the prefill kernel no longer specialises on
                    # those (kernels/attention.py). The first engine of each load still runs the workload once,
                    # unmeasured, on shifted token ids (the real ones would stay in the prefix cache), so that any
                    # other variant the workload needs (e.g. a decode split count only its mixed steps reach) is
                    # compiled before timing. Later loads (their own shapes or dtypes: kernels compile anew) run a
                    # quarter of it at full length, which reaches the same contexts and step mixes in a quarter of
                    # the time; `triton_compiles` in each result says if any compile was still left. An offline
                    # workload (W5) is measured as issue 49 defines it: after its own warm-up only.
                    full = warmup_requests(reqs, vocab_limit, full_length=True)
                    engine.generate(
                        with_variant(full if not results else full[: max(1, len(full) // 4)], is_json, num_top)
                    )
                first_of_load = False
                label = m + setup_suffix(decoder, gemm, determinism, model, precision, prefill)
                label += f"-{variant_name(is_json, num_top)}" if len(parsed) > 1 else ""
                tracer = StepTracer(dev) if trace_out else None
                result = run_engine_mode(engine, with_variant(reqs, is_json, num_top), label, bandwidth, tracer)
                if tracer is not None:
                    traces.append((label, tracer))
                    result.extra["trace"] = tracer.summary()
                result.extra.update(
                    model=model,
                    variant=variant_name(is_json, num_top),
                    precision=precision,
                    quantization=config.quantization,
                    kv_cache_dtype=config.kv_cache_dtype,
                    deterministic=determinism == "deterministic",
                    mla_prefill=prefill,
                    setup_seconds=setup,
                    num_kv_blocks=engine.runner.num_kv_blocks,
                    max_model_len=engine.max_model_len,
                    graphs=len(engine.runner.graphs),
                    decoder="owned" if engine.runner.decoder is not None else "hf",
                    small_step_gemm="invariant"  # every step's GEMMs: kernels/invariant_gemm.py
                    if config.deterministic
                    else "triton"
                    if getattr(engine.runner.decoder, "small_step_ops", None) is not None
                    else "cublas",
                )
                results.append(result)
                engine.close()  # a sharded engine's helper processes end here
                del engine
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            last = model == models[-1] and precision == (precisions or [None])[-1]
            if not last:  # the next load needs the memory (--compare-hf runs on the last one)
                del hf_model
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    hf_error = None
    if compare_hf:
        hf_reqs = reqs[:hf_num_requests] if hf_num_requests else reqs
        try:
            results.append(run_hf(hf_model, hf_reqs, hf_output_len))
        except Exception as exc:  # keep cbq's numbers even if transformers' API differs
            hf_error = f"{type(exc).__name__}: {exc}"
            click.echo(f"transformers generate_batch failed: {hf_error}", err=True)
    os.environ.pop(MLA_PREFILL_ENV, None)
    suffixes = [
        setup_suffix(d, g, k, n, p, f)
        for n in models
        for p in (precisions or [None])
        for d in decoders
        for g in decode_gemms
        for k in determinisms
        for f in mla_prefills
    ]
    print_ratios(results, suffixes, list(models), len(determinisms) > 1, len(precisions) > 1)
    print_table(workload, ", ".join(models), results)
    report = {
        "workload": workload,
        "model": models[0] if len(models) == 1 else list(models),
        "models": list(models),
        "num_requests": len(reqs),
        "workload_stats": {**workload_stats(reqs), "num_warmup_requests": len(warmup)},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_bytes_s": bandwidth,
        "load_seconds": next(iter(load_seconds.values())) if len(load_seconds) == 1 else load_seconds,
        "date": time.strftime("%Y-%m-%d"),
        "config": {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "cuda_graphs": not no_cuda_graphs,
            "prefix_caching": not no_prefix_caching,
            # with --precision, each run's quantization and KV dtype are in its result's extra
            **{k: v for k, v in engine_config.items() if not (precisions and k in PRECISIONS["fp8"])},
            "decoders": list(decoders),
            "decode_gemms": list(decode_gemms),
            "variants": [variant_name(*v) for v in parsed],
            "determinisms": determinisms,
            "precisions": list(precisions),
        },
        "results": {r.mode: asdict(r) for r in results},
        "trace": trace_out,
        "hf_error": hf_error,
    }
    if trace_out and traces:
        trace_json, trace_png, drawn_by = write_trace(trace_out, traces)
        click.echo(f"wrote {trace_json} and {trace_png} ({drawn_by})")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        click.echo(f"wrote {json_out}")


def parse_variant(text: str) -> tuple[bool, int | None]:
    """'plain', 'json', 'logprobs5', 'json+logprobs5' -> (constrain_json, top_logprobs)."""
    constrain, num_top = False, None
    for part in text.split("+"):
        if part == "json":
            constrain = True
        elif part.startswith("logprobs") and part[len("logprobs") :].isdigit():
            num_top = int(part[len("logprobs") :])
            if num_top > 20:
                raise click.BadParameter(f"at most 20 top logprobs, got {num_top}", param_hint="--variant")
        elif part != "plain":
            raise click.BadParameter(
                f"{text!r}: expected plain, json, logprobsK or json+logprobsK", param_hint="--variant"
            )
    return constrain, num_top


def variant_name(constrain_json: bool, top_logprobs: int | None) -> str:
    parts = (["json"] if constrain_json else []) + ([f"logprobs{top_logprobs}"] if top_logprobs is not None else [])
    return "+".join(parts) or "plain"
