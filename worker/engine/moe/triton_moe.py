"""The experts of an MoE layer as Triton grouped GEMMs over the step's tokens sorted by expert. Owns the launch
configurations (`LAUNCH_CONFIGS`); the buffers belong to the caller's `MoeWorkspace`.

One step, for T tokens and top-k routing (P = T * k (token, expert) pairs, pair p = token p // k):
  1. count   (grid E): tokens per expert.
  2. align   (grid E): each expert's pairs, in token order, laid out in a run padded to a multiple of BLOCK_M
             (padding slots hold the sentinel P); the expert of every BLOCK_M block; the padded total.
  3. gate/up (one launch): each program takes one block of BLOCK_M pairs (one expert) and BLOCK_N columns of
             both the gate and the up projection, so the activation (SiLU·mul or gpt-oss's clamped SwiGLU,
             with the expert biases) runs in its epilogue; it writes [P, I] rows indexed by pair.
  4. down    (one launch): the same blocks over [P, I] and the down projection, times each pair's routing
             weight, written as [P, H] rows indexed by pair: no atomics, each row has one writer.
  5. a sum over the k pairs of each token (fp32, rounded once), back in token order.
FP8 experts (`ExpertWeights.fp8`) take steps 3 and 4 as triton_fp8.py's e4m3 GEMMs, their inputs quantized first.
The grids are sized from T alone (the worst case of blocks for T * k pairs) and programs past the padded
total return at once, so nothing reads a device value on the host: a step is CUDA-graph capturable at a
fixed T. Decode (a few tokens per expert) and prefill (many) differ only in the launch configuration.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from .spec import Activation, MoeSpec
from .triton_fp8 import fp8_expert_gemms
from .weights import ExpertWeights

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

# the workspace's align buffers hold any block size in this range (tl.dot needs at least 16 rows)
MIN_BLOCK_M, MAX_BLOCK_M = 16, 128


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# (num_experts, expert intermediate size, device name) -> {at most this many tokens per step: config}.
# NOTE: these await tuning on the H200 (issue 25, item 4); they are the heuristic's choices written out for
# the two benchmark shapes, so a tuning run only has to replace numbers here.
_DECODE = LaunchConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
_MID = LaunchConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=4)
_PREFILL = LaunchConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
LAUNCH_CONFIGS: dict[tuple[int, int, str], dict[int, LaunchConfig]] = {
    (128, 768, "NVIDIA H200"): {64: _DECODE, 512: _MID, 1 << 30: _PREFILL},  # Qwen3-30B-A3B
    (32, 2880, "NVIDIA H200"): {16: _DECODE, 128: _MID, 1 << 30: _PREFILL},  # gpt-oss-20b
}
# Large steps of bf16 experts, whatever the table or the heuristic says below them: 128 x 128 tiles from
# LARGE_FROM_PAIRS pairs an expert. Measured: `benchmarks/moe_gemm.py` on an H100 (2026-12-06) timed one layer's
# experts at 2,048 and 8,192 tokens 1.19x and 1.27x _PREFILL's speed on the DeepSeek-V2-Lite shape, 1.10x and 1.20x on
# Qwen3-30B-A3B's, where _PREFILL stayed the best at 512 tokens and below. These steps are compute-bound and the H200
# has the H100's SMs. E4m3 experts (triton_fp8.py) keep the tables' and the heuristic's choice: not measured.
_LARGE = LaunchConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
LARGE_FROM_PAIRS = 128


def heuristic_config(spec: MoeSpec, num_tokens: int) -> LaunchConfig:
    """By the expected pairs per expert: under 16, one padded block per expert (decode); many, big tiles."""
    pairs_per_expert = num_tokens * spec.top_k / spec.num_experts
    if pairs_per_expert <= 16:
        return _DECODE
    return _MID if pairs_per_expert <= 64 else _PREFILL


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def config_for(spec: MoeSpec, num_tokens: int, device: torch.device, fp8: bool = False) -> LaunchConfig:
    """The step's configuration: _LARGE for a large step of bf16 experts, else the device's table for the shape,
    else the heuristic. `fp8`: e4m3 experts, which never take _LARGE."""
    if not fp8 and num_tokens * spec.top_k / spec.num_experts >= LARGE_FROM_PAIRS:
        return _LARGE
    name = _device_name(device)
    table = LAUNCH_CONFIGS.get((spec.num_experts, spec.expert_intermediate_size, name))
    if table is None:
        return heuristic_config(spec, num_tokens)
    return table[min((m for m in table if m >= num_tokens), default=max(table))]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks P pairs can need: each expert that gets any pads its last block, and at most
    min(E, P) experts get any."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


@dataclass(frozen=True)
class MoeWorkspace:
    """Buffers of one MoE step, sized once from the largest step (max tokens); a step uses their prefixes.
    Shared by every MoE layer (layers run one after another)."""

    max_tokens: int
    counts: torch.Tensor  # [E] int32
    num_padded: torch.Tensor  # [1] int32
    sorted_pair_ids: torch.Tensor  # [padded capacity] int32
    block_expert_ids: torch.Tensor  # [block capacity] int32
    activated: torch.Tensor  # [max_tokens * k, I] model dtype
    pair_out: torch.Tensor  # [max_tokens * k, H] model dtype

    @classmethod
    def allocate(
        cls, spec: MoeSpec, max_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> MoeWorkspace:
        num_pairs = max_tokens * spec.top_k

        def int32(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        return cls(
            max_tokens=max_tokens,
            counts=int32(spec.num_experts),
            num_padded=int32(1),
            sorted_pair_ids=int32(num_pairs + min(spec.num_experts, num_pairs) * (MAX_BLOCK_M - 1)),
            block_expert_ids=int32(max_blocks(num_pairs, spec.num_experts, MIN_BLOCK_M)),
            activated=torch.empty(num_pairs, spec.expert_intermediate_size, dtype=dtype, device=device),
            pair_out=torch.empty(num_pairs, spec.hidden_size, dtype=dtype, device=device),
        )


if HAVE_TRITON:
    from .block_order import block_operands, grouped_block

    # The pair and block counts change every step; specialised (Triton's == 1 and multiple-of-16 variants) they
    # made W1 on the Qwen3-30B-A3B shape compile 4 kernels inside the measured run (H200, 2026-12-01).
    @triton.jit(do_not_specialize=["num_pairs"])
    def _count_kernel(expert_ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr):
        expert = tl.program_id(0)
        total = 0
        for start in range(0, num_pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ids = tl.load(expert_ids_ptr + offs, mask=offs < num_pairs, other=-1)
            total += tl.sum((ids == expert).to(tl.int32), axis=0)
        tl.store(counts_ptr + expert, total)

    @triton.jit(do_not_specialize=["num_pairs", "num_experts"])
    def _align_kernel(
        expert_ids_ptr,
        counts_ptr,
        sorted_pairs_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_experts,
        BLOCK_M: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        expert = tl.program_id(0)
        experts = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        mine = experts == expert
        my_padded = tl.sum(tl.where(mine, padded, 0), axis=0)
        my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
        start = tl.sum(tl.where(mine, ends, 0), axis=0) - my_padded
        if expert == 0:
            tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        # the tail of my last block: sentinel pairs that the GEMMs mask out
        tail = my_count + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + start + tail, num_pairs, mask=tail < my_padded)
        for block in range(0, my_padded // BLOCK_M):
            tl.store(block_expert_ptr + start // BLOCK_M + block, expert)
        # my pairs in pair (hence token) order
        written = 0
        for chunk in range(0, num_pairs, BLOCK):
            offs = chunk + tl.arange(0, BLOCK)
            is_mine = tl.load(expert_ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert
            rank = tl.cumsum(is_mine.to(tl.int32), axis=0)
            tl.store(sorted_pairs_ptr + start + written + rank - 1, offs, mask=is_mine)
            written += tl.sum(is_mine.to(tl.int32), axis=0)

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _expert_gemm_kernel(
        a_ptr,  # [rows, K]: hidden (gate/up, row = pair // TOP_K) or the activated pairs (down, row = pair)
        w_ptr,  # [E, N (x2 for gate/up), K]
        bias_ptr,  # [E, N (x2)]
        pair_weight_ptr,  # [P] fp32 routing weights (down)
        out_ptr,  # [P, N]
        sorted_pairs_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_we,
        stride_be,
        alpha,
        limit,
        TOP_K: tl.constexpr,
        GATE_UP: tl.constexpr,
        ACTIVATION: tl.constexpr,  # 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pid_m, pid_n = grouped_block(N, num_blocks_m, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return  # past the padded total: this step has fewer blocks than the grid allows for
        expert, pairs, is_pair, _, cols, is_col, ks, a_ptrs, w_ptrs = block_operands(
            a_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, pid_m, pid_n, num_pairs, N, K, stride_we, TOP_K, GATE_UP,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # no mask along K (the contiguous dim), so the loads stay vectorised
                a_mask = is_pair[:, None]
                w_mask = is_col[None, :]
            else:
                k_ok = ks < K - k0
                a_mask = is_pair[:, None] & k_ok[None, :]
                w_mask = k_ok[:, None] & is_col[None, :]
            a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs + k0, mask=w_mask, other=0.0), acc, input_precision=DOT_PREC)
            if GATE_UP:  # the up rows sit N rows below the gate rows
                w_up = tl.load(w_ptrs + N * K + k0, mask=w_mask, other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PREC)
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=is_col, other=0.0).to(tl.float32)[
                None, :
            ]
        # round where the model rounds (each projection's output is in the model dtype)
        acc = acc.to(dtype).to(tl.float32)
        if GATE_UP:
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + expert * stride_be + N + cols, mask=is_col, other=0.0).to(
                    tl.float32
                )[None, :]
            up = acc_up.to(dtype).to(tl.float32)
            if ACTIVATION == 0:
                result = (acc / (1.0 + tl.exp(-acc))).to(dtype).to(tl.float32) * up
            else:
                gate = tl.minimum(acc, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                result = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            result = acc * tl.load(pair_weight_ptr + pairs, mask=is_pair, other=0.0)[:, None]
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptrs, result.to(dtype), mask=is_pair[:, None] & is_col[None, :])


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def experts_triton(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: ExpertWeights,
    spec: MoeSpec,
    workspace: MoeWorkspace,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """What `reference.experts_ref` computes, as five launches with no host sync ([T, H] in hidden's dtype)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = spec.num_experts, spec.expert_intermediate_size
    assert num_tokens <= workspace.max_tokens, (
        f"{num_tokens} tokens, workspace sized for {workspace.max_tokens}"
    )
    assert hidden.is_contiguous() and experts.gate_up.is_contiguous() and experts.down.is_contiguous()
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    config = config or config_for(spec, num_tokens, hidden.device, fp8=experts.fp8 is not None)
    if hidden.dtype == torch.float32 and config.num_stages > 2:
        # fp32 tiles take twice the shared memory per stage: the H200 refused the bf16 stage counts (245,760 of
        # 232,448 bytes) in the fp32 exactness tests, so fp32 (tests only) pipelines two stages.
        config = dataclasses.replace(config, num_stages=2)
    assert MIN_BLOCK_M <= config.block_m <= MAX_BLOCK_M and MAX_BLOCK_M % config.block_m == 0, config
    num_pairs = num_tokens * spec.top_k
    expert_ids = topk_ids.reshape(-1)
    pair_weights = topk_weights.reshape(-1).float()
    scan_block = min(1024, _next_pow2(num_pairs))
    _count_kernel[(num_experts,)](expert_ids, workspace.counts, num_pairs, BLOCK=scan_block)
    _align_kernel[(num_experts,)](
        expert_ids,
        workspace.counts,
        workspace.sorted_pair_ids,
        workspace.block_expert_ids,
        workspace.num_padded,
        num_pairs,
        num_experts,
        BLOCK_M=config.block_m,
        BLOCK_E=_next_pow2(num_experts),
        BLOCK=scan_block,
    )
    blocks_m = max_blocks(num_pairs, num_experts, config.block_m)
    activated, pair_out = workspace.activated[:num_pairs], workspace.pair_out[:num_pairs]
    has_bias = experts.gate_up_bias is not None
    common: dict[str, Any] = dict(
        sorted_pairs_ptr=workspace.sorted_pair_ids,
        block_expert_ptr=workspace.block_expert_ids,
        num_padded_ptr=workspace.num_padded,
        num_pairs=num_pairs,
        num_blocks_m=blocks_m,
        alpha=spec.swiglu_alpha,
        limit=spec.swiglu_limit,
        TOP_K=spec.top_k,
        ACTIVATION=0 if spec.activation is Activation.SILU_MUL else 1,
        HAS_BIAS=has_bias,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if experts.fp8 is not None:  # e4m3 experts: their own GEMMs (triton_fp8.py), the same align and sum
        fp8_expert_gemms(hidden, experts, activated, pair_out, pair_weights, common, config.block_k, blocks_m)
        return _sum_pairs(pair_out, num_tokens, spec, hidden.dtype)
    common |= dict(
        BLOCK_K=config.block_k,
        # fp32 operands: exact products (no tf32), so the fp32 path tracks the reference to ~1e-6
        DOT_PREC="ieee" if hidden.dtype == torch.float32 else "tf32",
    )
    # (A rows, weights [E, N (x2), K], bias or None, out [P, N], N, K, gate/up?)
    projections = (
        (hidden, experts.gate_up, experts.gate_up_bias, activated, inter, hidden_size, True),
        (activated, experts.down, experts.down_bias, pair_out, hidden_size, inter, False),
    )
    for a, weight, bias, out, n, k, is_gate_up in projections:
        _expert_gemm_kernel[(blocks_m * triton.cdiv(n, config.block_n),)](
            a,
            weight,
            weight if bias is None else bias,  # never read without HAS_BIAS
            pair_weights,
            out,
            N=n,
            K=k,
            stride_we=weight.stride(0),
            stride_be=0 if bias is None else bias.stride(0),
            GATE_UP=is_gate_up,
            EVEN_K=k % config.block_k == 0,
            **common,
        )
    return _sum_pairs(pair_out, num_tokens, spec, hidden.dtype)


def _sum_pairs(pair_out: torch.Tensor, num_tokens: int, spec: MoeSpec, dtype: torch.dtype) -> torch.Tensor:
    """Step 5: each token's k weighted expert outputs summed in fp32, rounded once, in token order."""
    return pair_out.view(num_tokens, spec.top_k, spec.hidden_size).sum(dim=1, dtype=torch.float32).to(dtype)
