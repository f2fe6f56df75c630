"""The memory/compute floor of the steps a `bench engine` run took: what each step reads (weights, the KV its
attention reads) at the measured copy bandwidth, and what it computes at the tensor cores' peak, step by step.

Owns the peaks (PEAK_BF16_FLOPS measured, PEAK_FP8_FLOPS by the spec sheets' ratio) and the byte counts of a model;
`engine_floors` picks the dense or the mixture-of-experts floor for a loaded model.
"""

from __future__ import annotations

PEAK_BF16_FLOPS = 790e12  # measured on this workplace's H200 (8192^3 bf16 GEMM); a lead elsewhere
# FP8 tensor cores: twice the bf16 rate on Hopper (the spec sheets' ratio; not measured here). The floor of a
# model with FP8 linears computes its weight GEMMs at this rate, and reads its weights and KV at 1 byte each.
PEAK_FP8_FLOPS = 2 * PEAK_BF16_FLOPS


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
    linears (quant/) hold their weights and scales as buffers: their bytes count, their scales are no parameters.
    Packed INT4 linears (quant/int4/) likewise: 0.5 byte a weight (the int32 words), plus the group scales and zeros
    (the act-order permutation is read once per step too; none here)."""
    from worker.engine.quant.int4.linear import Int4LinearModule
    from worker.engine.quant.linear import Fp8LinearModule

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lookup_only = head is None or head.weight is not embed
    quantized = [m for m in model.modules() if isinstance(m, Fp8LinearModule | Int4LinearModule)]
    tensors = [*model.parameters(), *(b for m in quantized for b in m.buffers(recurse=False) if b is not None)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    weights = sum(m.out_features * m.in_features for m in quantized)
    params = sum(p.numel() for p in model.parameters()) + weights
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
