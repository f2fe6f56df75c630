"""`cbq bench engine`: a workload through the engine, sync vs async, vs transformers' own continuous batching.

Prints a table and writes JSON with every number, including the memory/compute floor of every step.
Variants run the same requests constrained to a small JSON schema and/or asking for top logprobs
(`--variant plain --variant json --variant logprobs5`), each in every mode, in one process; `--deterministic`
runs every setup in deterministic and in default mode (EngineConfig.deterministic), also in one process;
`--precision bf16 --precision fp8` runs the model in bf16 and with FP8 weights and KV (`--quantization fp8
--kv-cache-dtype fp8`), one model after the other, in one process.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import click

from worker.bench.cache_workloads import CACHE_WORKLOADS, make_cache_workload
from worker.bench.common import WORKLOADS, make_workload, triton_compiles, warmup_requests, with_variant
from worker.cli_options import (
    deterministic_option,
    gpu_memory_options,
    quantization_options,
    tensor_parallel_option,
)
from worker.engine.config import DECODE_GEMMS, DECODERS, EngineConfig

ENGINE_DEFAULTS = EngineConfig()
PEAK_BF16_FLOPS = 790e12  # measured on this workplace's H200 (8192^3 bf16 GEMM); a lead elsewhere
# FP8 tensor cores: twice the bf16 rate on Hopper (the spec sheets' ratio; not measured here). The floor of a
# model with FP8 linears computes its weight GEMMs at this rate, and reads its weights and KV at 1 byte each.
PEAK_FP8_FLOPS = 2 * PEAK_BF16_FLOPS
# `--precision`: what each name sets (EngineConfig fields; the model loads with its quantization)
PRECISIONS: dict[str, dict[str, str | None]] = {
    "bf16": {"quantization": None, "kv_cache_dtype": "auto"},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "fp8-weights": {"quantization": "fp8", "kv_cache_dtype": "auto"},  # the two halves of "fp8", to tell them apart
    "fp8-kv": {"quantization": None, "kv_cache_dtype": "fp8"},
}


@dataclass
class ModeResult:
    mode: str
    output_tokens: int
    wall_seconds: float
    output_tok_s: float
    total_tok_s: float
    steps: int = 0
    step_ms: float = 0.0  # wall time per step
    gpu_ms: float = 0.0  # device time per step (CUDA events on the compute stream)
    cpu_prep_ms: float = 0.0  # scheduling + batch building per step
    mask_ms: float = 0.0  # host time computing constraint masks per step (overlaps the forward in async)
    gpu_busy: float = 0.0  # device time / wall time
    floor_seconds: float = 0.0  # sum over steps of max(bytes / bandwidth, flops / peak)
    floor_ratio: float = 0.0  # floor_seconds / wall_seconds: 1.0 would be at the floor
    floor_tok_s: float = 0.0
    serial_floor_ratio: float = 0.0  # the same with GEMMs and KV reads back to back (floor_seconds' `serial`)
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / looked up
    extra: dict = field(default_factory=dict)


def measure_copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import torch

    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds


def model_bytes(model) -> tuple[int, int]:
    """(bytes of weights read per step, non-embedding parameter count). The input embedding is a lookup, unless
    it is tied to the LM head (Gemma), which reads it whole every step (`model.parameters()` holds it once). FP8
    linears (quant/) hold their weights and scales as buffers: their bytes count, their scales are no parameters."""
    from worker.engine.quant.linear import Fp8LinearModule

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lookup_only = head is None or head.weight is not embed
    fp8 = [m for m in model.modules() if isinstance(m, Fp8LinearModule)]
    tensors = [*model.parameters(), *(b for m in fp8 for b in m.buffers(recurse=False))]
    total = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(p.numel() for p in model.parameters()) + sum(m.weight.numel() for m in fp8)
    if lookup_only:
        return total - embed.numel() * embed.element_size(), params - embed.numel()
    return total, params


def floor_seconds(
    step_log,
    weight_bytes: int,
    num_params: int,
    kv_bytes_per_token: int,
    bandwidth: float,
    serial: bool = False,
    windows: tuple[int, ...] = (),
    peak_flops: float = PEAK_BF16_FLOPS,
) -> float:
    """Sum over the steps cbq ran of the least time each could take: max(bytes / bandwidth, flops / peak).

    `serial`: the weight GEMMs (bound by streaming their weights or by their FLOPs, whichever is slower) and then
    the KV reads, one after the other, as kernels on one stream run. The default floor lets a step's KV reads
    hide under its GEMMs' compute; no engine that runs them back to back can reach it in a step where both are
    large (W2's: benchmarks/archive/HISTORY.md, "why W2 stops at the serial bound").
    `windows`: each layer's sliding window (0: full attention; () none slides): a sliding layer reads at most
    `num_seqs * window` of the step's cached tokens (Gemma 3's five local layers in six; moe/cost.py alike)."""
    if bandwidth <= 0:
        return 0.0
    total = 0.0
    for num_tokens, num_seqs, context_tokens, _dev in step_log:
        weights = weight_bytes / bandwidth
        tokens_read = context_tokens
        if windows:  # the mean over layers of what each reads
            tokens_read = sum(min(context_tokens, num_seqs * w) if w else context_tokens for w in windows) / len(windows)
        kv_reads = tokens_read * kv_bytes_per_token / bandwidth
        compute = 2 * num_params * num_tokens / peak_flops
        total += max(weights, compute) + kv_reads if serial else max(weights + kv_reads, compute)
    return total


def moe_floor_seconds(
    step_log,
    shape,
    dtype_bytes: int,
    bandwidth: float,
    serial: bool = False,
    expert_bytes_per_param: float | None = None,
    peak_flops: float = PEAK_BF16_FLOPS,
) -> float:
    """`floor_seconds` for a mixture of experts (`shape`: moe/cost.py's MoeModelShape): each step reads the dense
    weights, only the experts its tokens hit (distinct experts per layer), and the KV its attention reads (sliding
    windows bounded), and computes the FLOPs of the parameters its tokens activate (moe/cost.py's `step_cost`).
    `expert_bytes_per_param`: the experts' bytes a weight where they are not in the model dtype (FP8 experts)."""
    from worker.engine.moe.cost import step_cost

    if bandwidth <= 0:
        return 0.0
    total = 0.0
    for num_tokens, num_seqs, context_tokens, _dev in step_log:
        cost = step_cost(shape, num_tokens, num_seqs, context_tokens, dtype_bytes, expert_bytes_per_param)
        weights = (cost.dense_bytes + cost.expert_bytes) / bandwidth
        kv_reads = cost.kv_bytes / bandwidth
        compute = cost.flops / peak_flops
        total += max(weights, compute) + kv_reads if serial else max(weights + kv_reads, compute)
    return total


def engine_floors(model, step_log, bandwidth: float, kv_dtype=None) -> tuple[float, float]:
    """(floor, serial floor) in seconds of the steps in `step_log`: a mixture of experts (its family declares a
    sparse MLP) by `moe_floor_seconds`, a dense model by `floor_seconds` (every weight read every step).
    `kv_dtype`: the KV cache's element type (default the model's; FP8 halves the KV bytes)."""
    from worker.engine.attention_backend import sliding_windows_of
    from worker.engine.kv_cache import kv_bytes_per_block
    from worker.engine.models import family_for

    if family_for(model.config)[0].moe is not None:
        from worker.engine.moe.cost import MoeModelShape, fp8_expert_bytes_per_param
        from worker.engine.moe.fp8_experts import expert_format_of

        shape = MoeModelShape.from_config(model.config)
        dtype_bytes = model.dtype.itemsize
        # FP8 experts (moe/fp8_experts.py): 1 byte a weight and their scales, their GEMMs at the FP8 rate
        fp8_experts = expert_format_of(model)
        per_param = None if fp8_experts is None else fp8_expert_bytes_per_param(shape.spec, fp8_experts)
        moe_peak = PEAK_BF16_FLOPS if fp8_experts is None else PEAK_FP8_FLOPS
        return (
            moe_floor_seconds(step_log, shape, dtype_bytes, bandwidth, False, per_param, moe_peak),
            moe_floor_seconds(step_log, shape, dtype_bytes, bandwidth, True, per_param, moe_peak),
        )
    from worker.engine.quant.linear import Fp8LinearModule

    weight_bytes, num_params = model_bytes(model)
    kv_per_token = kv_bytes_per_block(model.config, 1, kv_dtype or model.dtype)
    windows = sliding_windows_of(model.config)
    is_fp8 = any(isinstance(m, Fp8LinearModule) for m in model.modules())
    peak = PEAK_FP8_FLOPS if is_fp8 else PEAK_BF16_FLOPS
    return (
        floor_seconds(step_log, weight_bytes, num_params, kv_per_token, bandwidth, windows=windows, peak_flops=peak),
        floor_seconds(
            step_log, weight_bytes, num_params, kv_per_token, bandwidth, serial=True, windows=windows, peak_flops=peak
        ),
    )


def run_engine_mode(engine, reqs, mode: str, bandwidth: float) -> ModeResult:
    from worker.engine.kv_cache import kv_cache_dtype

    engine.reset_stats()
    with triton_compiles() as compiled:
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t0
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


def tokens_digest(results) -> str:
    """A hash of every request's tokens in request order: two runs of the same requests agree on every token
    iff their digests are equal (sync vs async in deterministic mode)."""
    digest = hashlib.sha256()
    for r in sorted(results, key=lambda r: r.request_id):
        for sample in r.all_samples:
            digest.update(f"{r.request_id}:{sample.token_ids}\n".encode())
    return digest.hexdigest()[:16]


def slowest_steps(step_log, count: int = 3) -> list[dict]:
    """The steps with the most device time (a stall inside one shows here first)."""
    top = sorted(step_log, key=lambda step: -step[3])[:count]
    return [
        {"tokens": tokens, "seqs": seqs, "context_tokens": context, "device_ms": 1000 * device}
        for tokens, seqs, context, device in top
    ]


def run_hf(model, reqs, output_len_cap: int | None) -> ModeResult:
    """transformers' own continuous batching (`generate_batch`) on the same model and prompts."""
    import torch
    from transformers import GenerationConfig

    max_new = max(r.sampling.max_new_tokens for r in reqs)
    if output_len_cap:
        max_new = min(max_new, output_len_cap)
    saved = (
        model.config._attn_implementation,
        model.config.eos_token_id,
        model.generation_config.eos_token_id,
    )
    model.set_attn_implementation("paged|sdpa")
    model.config.eos_token_id = None  # random weights: lengths are fixed by the workload, as for cbq
    model.generation_config.eos_token_id = None
    try:
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
        model.set_attn_implementation(saved[0])
        model.config.eos_token_id, model.generation_config.eos_token_id = saved[1], saved[2]
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


def print_table(workload: str, model_name: str, results: list[ModeResult]) -> None:
    cols = [
        "mode",
        "out tok/s",
        "total tok/s",
        "steps",
        "step ms",
        "gpu ms",
        "prep ms",
        "mask ms",
        "busy",
        "floor tok/s",
        "floor ratio",
        "serial ratio",
        "preempt",
        "cache hits",
    ]
    click.echo(f"\n{workload} on {model_name}")
    click.echo(" | ".join(f"{c:>11}" for c in cols))
    for r in results:
        row = [
            r.mode,
            f"{r.output_tok_s:,.0f}",
            f"{r.total_tok_s:,.0f}",
            r.steps,
            f"{r.step_ms:.2f}",
            f"{r.gpu_ms:.2f}",
            f"{r.cpu_prep_ms:.3f}",
            f"{r.mask_ms:.3f}",
            f"{r.gpu_busy:.1%}",
            f"{r.floor_tok_s:,.0f}",
            f"{r.floor_ratio:.2f}",
            f"{r.serial_floor_ratio:.2f}",
            r.num_preemptions,
            f"{r.prefix_cache_hit_rate:.1%}",
        ]
        click.echo(" | ".join(f"{str(v):>11}" for v in row))


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
    "--workload", type=click.Choice(list(WORKLOADS) + list(CACHE_WORKLOADS)), default="W1", show_default=True
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
@click.option(
    "--decoder",
    "decoders",
    type=click.Choice(DECODERS),
    multiple=True,
    default=("auto",),
    show_default=True,
    help="Decoder(s) to run, each in every mode (repeat to compare; results are then named MODE-DECODER).",
)
@click.option(
    "--decode-gemm",
    "decode_gemms",
    type=click.Choice(DECODE_GEMMS),
    multiple=True,
    default=("auto",),
    show_default=True,
    help="Small-step GEMM path(s) of the owned decoder (EngineConfig.decode_gemm; repeat to compare in "
    "one process; results are then named MODE-...-GEMM).",
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
    "fp8-weights, fp8-kv: one of the two. Repeat to compare in one process (the models load one after the other); "
    "results are then named MODE-...-PRECISION. Overrides --quantization and --kv-cache-dtype.",
)
@click.option("--device", default=ENGINE_DEFAULTS.device, show_default=True)
@click.option("--dtype", default=ENGINE_DEFAULTS.dtype, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
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
    constrain_json,
    top_logprobs,
    variants,
    precisions,
    device,
    dtype,
    json_out,
):
    """Run a workload through the engine in sync and/or async mode and report throughput vs the floor."""
    import torch

    from worker.engine.engine import Engine
    from worker.engine.models import family_for, load_model, resolve_device, resolve_dtype
    from worker.engine.models.loader import check_moe_fit
    from worker.engine.moe.fp8_experts import expert_format_of
    from worker.engine.ranks import build_sharded_engine, sharded_model_config

    if len(precisions) > 1 and compare_hf:
        raise click.UsageError("--compare-hf runs one model: give at most one --precision with it")
    dev = resolve_device(device)
    # Tensor parallelism: each run's engine loads its own shards on every rank (no whole model here).
    is_sharded = engine_config.get("tensor_parallel_size", 1) > 1
    if is_sharded and compare_hf:
        raise click.ClickException("--compare-hf runs the whole model in one process: not with --tensor-parallel-size")
    modes = {"both": ["sync", "async"], "none": []}.get(mode, [mode])
    parsed = variants or [(constrain_json, top_logprobs)]
    results: list[ModeResult] = []
    # --deterministic runs every setup twice in this process, deterministic then default (named MODE-...-
    # deterministic and MODE-...-default), so that the cost of the mode is measured on one warm device.
    determinisms = ["deterministic", "default"] if engine_config.pop("deterministic", False) else ["default"]
    runs = [  # every setup, run for each (model, precision) in turn
        (d, g, k, m, v)
        for d in decoders
        for g in decode_gemms
        for k in determinisms
        for v in parsed
        for m in modes
    ]

    def setup_suffix(
        decoder: str, gemm: str, determinism: str, model: str = "", precision: str | None = None
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
            warmup = warmup_requests(reqs, vocab_limit)
            first_of_load = True
            for decoder, gemm, determinism, m, (is_json, num_top) in runs:
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
                if first_of_load and dev.type == "cuda":
                    # NOTE: on the H200 a process's first measured run was up to ~19% slower on the device. The
                    # cause was a Triton compile inside a step (a prefill-kernel variant for a mixed step's counts,
                    # 1.4 s, which the step's device events count); the prefill kernel no longer specialises on
                    # those (kernels/attention.py). The first engine of each load still runs the workload once,
                    # unmeasured, on shifted token ids (the real ones would stay in the prefix cache), so that any
                    # other variant the workload needs (e.g. a decode split count only its mixed steps reach) is
                    # compiled before timing. Later loads (their own shapes or dtypes: kernels compile anew) run a
                    # quarter of it at full length, which reaches the same contexts and step mixes in a quarter of
                    # the time; `triton_compiles` in each result says if any compile was still left.
                    full = warmup_requests(reqs, vocab_limit, full_length=True)
                    engine.generate(
                        with_variant(full if not results else full[: max(1, len(full) // 4)], is_json, num_top)
                    )
                first_of_load = False
                label = m + setup_suffix(decoder, gemm, determinism, model, precision)
                label += f"-{variant_name(is_json, num_top)}" if len(parsed) > 1 else ""
                result = run_engine_mode(engine, with_variant(reqs, is_json, num_top), label, bandwidth)
                result.extra.update(
                    model=model,
                    variant=variant_name(is_json, num_top),
                    precision=precision,
                    quantization=config.quantization,
                    kv_cache_dtype=config.kv_cache_dtype,
                    deterministic=determinism == "deterministic",
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
    by_mode = {r.mode: r for r in results}
    suffixes = (
        setup_suffix(d, g, k, n, p)
        for n in models
        for p in (precisions or [None])
        for d in decoders
        for g in decode_gemms
        for k in determinisms
    )
    for suffix in suffixes:
        if f"sync{suffix}" in by_mode and f"async{suffix}" in by_mode:
            ratio = by_mode[f"async{suffix}"].output_tok_s / by_mode[f"sync{suffix}"].output_tok_s
            click.echo(f"async/sync output tok/s{suffix}: {ratio:.3f}")
            same = by_mode[f"async{suffix}"].extra["tokens_digest"] == by_mode[f"sync{suffix}"].extra["tokens_digest"]
            click.echo(f"async and sync tokens{suffix}: {'identical' if same else 'differ'}")
    if len(determinisms) > 1:
        for r in results:
            other = by_mode.get(r.mode.replace("-deterministic", "-default"))
            if "-deterministic" in r.mode and other is not None:
                click.echo(f"{r.mode} / {other.mode} output tok/s: {r.output_tok_s / other.output_tok_s:.3f}")
    if len(precisions) > 1:
        for r in results:
            precision = r.extra.get("precision")
            other = by_mode.get(r.mode.replace(f"-{precision}", "-bf16"))
            if precision not in (None, "bf16") and other is not None:
                click.echo(f"{r.mode} / {other.mode} output tok/s: {r.output_tok_s / other.output_tok_s:.3f}")
    plain = [r for r in results if r.extra.get("variant") == "plain"]
    for r in results:
        if "variant" not in r.extra:  # transformers' run
            continue
        base = next((p for p in plain if r.mode.replace(r.extra["variant"], "plain") == p.mode), None)
        if base is not None and r is not base:
            click.echo(f"{r.mode} / {base.mode} output tok/s: {r.output_tok_s / base.output_tok_s:.3f}")
    if len(models) > 1:  # each model's floor ratio against the first's, run by run (issue 24: within 10%)
        for r in results:
            first = by_mode.get(r.mode.replace(r.extra.get("model", ""), models[0]))
            if first is not None and r is not first and r.extra.get("model") and first.floor_ratio:
                click.echo(f"{r.mode} floor ratio / {first.mode}'s: {r.floor_ratio / first.floor_ratio:.3f}")
    print_table(workload, ", ".join(models), results)
    report = {
        "workload": workload,
        "model": models[0] if len(models) == 1 else list(models),
        "models": list(models),
        "num_requests": len(reqs),
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
        "hf_error": hf_error,
    }
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
