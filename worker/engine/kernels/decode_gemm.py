"""Weight GEMMs of small decode steps (at most 32 tokens) as Triton kernels that take part in programmatic
dependent launch (pdl.py). Owns nothing.

Why: a W1 decode step (32 sequences, Llama-3-8B) is ~4 ms of weight GEMMs against 3.5 ms of weight bytes at
the copy bandwidth, plus ~10 small kernels per layer, and inside a CUDA graph every kernel still starts cold
after the one before it has drained. cuBLAS cannot take part in PDL; these kernels can, so on the small-step
path every kernel of the owned decoder's layer is already placed on the SMs, waiting, when its predecessor
finishes (measured on the H200: benchmarks/README.md, "Small decode steps").

Each program owns BLOCK_N whole weight rows over all of K (no split-K, so no reduce kernel and no atomics)
and computes W_tile @ x^T, the weight rows being the MMA's long side. A row's result depends only on its own
input row and K's fixed tile order, not on how many rows the step has.

`decode_gate_up_silu` runs the gate/up projection with SiLU·mul (or GELU-tanh·mul: Gemma) in its epilogue: a program owns BLOCK_N gate
rows and the BLOCK_N up rows that pair with them (the fused [gate; up] weight, no new layout), so the [M, 2I]
gate/up output and the silu_mul kernel that read it are gone. It rounds as the unfused pair does (each
product to the model dtype, SiLU rounded, then the multiply), so the two agree bit for bit.

What was measured and left out: prefetching each program's first weight bytes into L2 before the PDL wait
(no gain: W1 5,721 vs 5,699 tok/s), SiLU·mul fused into the down projection's input load (the loads then
stopped pipelining: 204 vs 36 us per GEMM), and the down projection itself (kept on cuBLAS, see MAX_K).

`decode_qkv_rope_write` is the QKV projection with rotary and the KV-cache write in its epilogue (families
without q/k norms: Llama, Mistral, Qwen2; Qwen3's norms need a whole head, which a program does not hold). A
program owns 32 rotary pairs of one head, i.e. weight rows j and j + D/2 for 32 consecutive j, so the pairs meet
in its registers; it writes rotated q, and k and v straight into the paged cache. The [M, (H + 2 KVH) D] QKV
output and the qkv_rope_write kernel that read it are gone; the result equals the two launches bit for bit. The
epilogue (`rope_tile_rows`, `qkv_rope_epilogue`) is shared with quant/small_step.py's FP8 QKV kernel.

Only bf16/fp16 on CUDA sm90+ with shapes that tile (`config_for`) in the decoder; anything else is cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused as fk
from .common import HAVE_TRITON, dot_precision, next_pow2, tl, triton

if HAVE_TRITON:
    from .common import to_kv_cache
from .pdl import pdl_usable

if HAVE_TRITON:
    from .fused import activation, rotate_halves
    from .pdl import pdl_wait_and_release

MAX_TOKENS = 32  # steps with more rows keep cuBLAS (at M = 64 cuBLAS won on O, gate/up and down)

# (BLOCK_N weight rows per program, BLOCK_K, num_warps, num_stages): the best or within 2% of the best
# at M = 32 per Llama-3-8B projection, from `benchmarks/skinny_gemm.py --sweep` on the H200.
Config = tuple[int, int, int, int]
NARROW_CONFIG: Config = (64, 64, 4, 8)  # QKV, O: N <= 8192
WIDE_CONFIG: Config = (64, 128, 4, 4)  # gate/up, lm_head: N > 8192
# Deeper products (the down projection, K = 14336) keep cuBLAS: in the layer chain on the H200 the Triton
# down GEMM under PDL cost 14 us per layer more than cuBLAS (141.1 vs 127.1 us per layer,
# `benchmarks/skinny_gemm.py --chain`), and it was 2 us slower alone.
MAX_K = 8192
# decode_gate_up_silu: BLOCK_N gate rows and as many up rows per program. In the layer chain on the H200
# (`benchmarks/skinny_gemm.py --chain`): 125.3 us per layer against 127.4 for the two launches (122.9 against
# 125.6 in a second call); 32 rows per half (as many weight rows per program as WIDE_CONFIG) was 149-152.
GATED_CONFIG: Config = (64, 128, 4, 4)
# decode_qkv_rope_write: 64 weight rows (32 rotary pairs) per program, as the plain QKV GEMM's NARROW_CONFIG.
ROPE_CONFIG: Config = NARROW_CONFIG
ROPE_PAIRS = 32


def config_for(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Config | None:
    """The launch configuration for a [*, k] x [n, k]^T product, or None for cuBLAS (too deep, or the
    shape does not tile)."""
    return _fitted(WIDE_CONFIG if n > 8192 else NARROW_CONFIG, n, k, dtype)


def gated_config_for(inter: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Config | None:
    """The launch configuration of `decode_gate_up_silu` for intermediate size `inter`, or None (unfused)."""
    return _fitted(GATED_CONFIG, inter, k, dtype)


def rope_config_for(num_heads: int, num_kv_heads: int, head_dim: int, k: int, dtype: torch.dtype) -> Config | None:
    """The launch configuration of `decode_qkv_rope_write`, or None (two launches): each head's half must hold
    whole groups of ROPE_PAIRS pairs."""
    if head_dim % (2 * ROPE_PAIRS) or ROPE_CONFIG[0] != 2 * ROPE_PAIRS:
        return None
    return _fitted(ROPE_CONFIG, (num_heads + 2 * num_kv_heads) * head_dim, k, dtype)


def block_m_for(m: int) -> int:
    """Rows of x per program: M rounded up to a power of two, at least 16 (the MMA's minimum), at most 64."""
    return max(16, next_pow2(min(m, 64)))


def _fitted(config: Config, n: int, k: int, dtype: torch.dtype, max_k: int | None = MAX_K) -> Config | None:
    """`config` where [n, k] tiles by it (and k is at most `max_k`: None for any depth), else None."""
    if (max_k is not None and k > max_k) or n % config[0] or k % config[1]:
        return None
    if dtype == torch.float32:  # tests only: fp32 tiles take twice the shared memory per stage
        return (*config[:3], 2)
    return config


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the decoder can run its small-step GEMMs here (CUDA sm90+, bf16/fp16)."""
    return dtype in (torch.bfloat16, torch.float16) and pdl_usable(device)


if HAVE_TRITON:

    @triton.jit
    def _grouped_tile(pid, num_pid_m, GROUP_N: tl.constexpr):
        """(N tile, M block) of program `pid` when programs run GROUP_N weight tiles across every M block before the
        next GROUP_N: a wave of programs then shares a few weight tiles and a few blocks of x through L2 instead of
        rereading the whole weight for each M block (large M: deterministic mode's prefill steps). Only the order
        of the programs changes, never a program's arithmetic: the output bits are the 2-D grid's."""
        num_pid_n = tl.num_programs(0) // num_pid_m
        per_group = GROUP_N * num_pid_m
        first_n = (pid // per_group) * GROUP_N
        group_size = tl.minimum(num_pid_n - first_n, GROUP_N)
        return first_n + (pid % per_group) % group_size, (pid % per_group) // group_size

    @triton.jit
    def _decode_gemm_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        up_rows,  # GATED: the up rows start this many rows after the gate rows (I)
        stride_xm,
        stride_wn,
        stride_om,
        K_TILES: tl.constexpr,  # K // BLOCK_K: a fixed trip count per weight shape
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,  # out = act(x @ gate^T) * (x @ up^T)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        DOT_PREC: tl.constexpr,
        ACT: tl.constexpr = 0,  # fused.ACT_SILU or ACT_GELU_TANH
        GROUP_N: tl.constexpr = 0,  # 0: a 2-D grid (N tile, M block); > 0: `_grouped_tile`'s 1-D order
    ):
        pdl_wait_and_release(USE_PDL)
        if GROUP_N > 0:
            pid_n, pid_m = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), GROUP_N)
        else:
            pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]
        up_ptrs = w_ptr + (rn[:, None] + up_rows).to(tl.int64) * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(K_TILES):
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(w, x, acc, input_precision=DOT_PREC)
            if GATED:
                acc_up = tl.dot(tl.load(up_ptrs), x, acc_up, input_precision=DOT_PREC)
                up_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
            if GATED:
                acc_up += tl.load(bias_ptr + up_rows + rn).to(tl.float32)[:, None]
        if GATED:  # rounded as the unfused GEMM + act_mul kernel round
            dtype = out_ptr.dtype.element_ty
            gate = acc.to(dtype).to(tl.float32)
            act = activation(gate, ACT).to(dtype).to(tl.float32)
            acc = act * acc_up.to(dtype).to(tl.float32)
        out_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])

    @triton.jit
    def rope_tile_rows(HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr):
        """(head, first, col) of program_id(0) in a QKV GEMM with the rotary epilogue: its head of the
        [q heads | k heads | v heads] rows, its first rotary pair, and the QKV weight row of each of its 2 PAIRS
        tile rows (row r < PAIRS is column first + r of the head, row PAIRS + r its partner first + r + D/2)."""
        HALF: tl.constexpr = HEAD_DIM // 2
        GROUPS: tl.constexpr = HALF // PAIRS  # programs per head
        head = tl.program_id(0) // GROUPS
        first = (tl.program_id(0) % GROUPS) * PAIRS
        r = tl.arange(0, 2 * PAIRS)
        col = head * HEAD_DIM + first + (r % PAIRS) + (r // PAIRS) * HALF
        return head, first, col

    @triton.jit
    def qkv_rope_epilogue(
        acc,  # fp32 [2 PAIRS, BLOCK_M]: the tile rows `rope_tile_rows` names, bias added, not yet rounded
        head,
        first,
        rm,
        m_mask,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_inv,
        v_scale_inv,
        stride_cos,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAIRS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """The QKV output rounded to q's dtype (as the GEMM's output is), rotated as qkv_rope_write rotates it,
        q stored, k and v written into the paged caches (an e4m3 cache with 1 / its scale). Shared by this file's
        bf16 kernel and quant/small_step.py's FP8 one, so both compute the two launches' bits."""
        HALF: tl.constexpr = HEAD_DIM // 2
        j = first + tl.arange(0, PAIRS)  # first-half columns of this program's pairs
        dtype = q_ptr.dtype.element_ty
        acc = acc.to(dtype).to(tl.float32)  # rounded as the QKV GEMM's output is
        x1, x2 = tl.split(tl.permute(tl.reshape(acc, [2, PAIRS, BLOCK_M]), (1, 2, 0)))  # [PAIRS, BLOCK_M] each
        if head < NUM_HEADS + NUM_KV_HEADS:  # q and k: rotary as qkv_rope_write computes it
            pos = tl.load(pos_ptr + rm, mask=m_mask, other=0).to(tl.int64)
            y1, y2 = rotate_halves(x1, x2, cos_ptr, sin_ptr, pos[None, :] * stride_cos + j[:, None], m_mask[None, :], HALF)
        else:
            y1 = x1
            y2 = x2
        mask = m_mask[None, :]
        if head < NUM_HEADS:
            q_dst = q_ptr + rm[None, :].to(tl.int64) * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + j[:, None]
            tl.store(q_dst, y1.to(dtype), mask=mask)
            tl.store(q_dst + HALF, y2.to(dtype), mask=mask)
        else:  # padding rows' slots point into scratch block 0, as qkv_rope_write's do
            slot = tl.load(slot_ptr + rm, mask=m_mask, other=0).to(tl.int64)
            blk = (slot // BLOCK_SIZE)[None, :]
            off = (slot % BLOCK_SIZE)[None, :]
            if head < NUM_HEADS + NUM_KV_HEADS:
                kv_head = head - NUM_HEADS
                dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + kv_head * stride_kch + j[:, None]
                scale_inv = k_scale_inv
            else:
                kv_head = head - NUM_HEADS - NUM_KV_HEADS
                dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + kv_head * stride_vch + j[:, None]
                scale_inv = v_scale_inv
            tl.store(dst, to_kv_cache(y1, scale_inv, k_cache_ptr, dtype), mask=mask)
            tl.store(dst + HALF, to_kv_cache(y2, scale_inv, k_cache_ptr, dtype), mask=mask)

    @triton.jit
    def _qkv_rope_gemm_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        M,
        k_scale_inv,
        v_scale_inv,
        stride_xm,
        stride_wn,
        stride_cos,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAIRS: tl.constexpr,  # rotary pairs per program: 2 * PAIRS weight rows
        BLOCK_SIZE: tl.constexpr,  # KV-cache block size
        K_TILES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pdl_wait_and_release(USE_PDL)
        head, first, col = rope_tile_rows(HEAD_DIM, PAIRS)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        w_ptrs = w_ptr + col[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]
        acc = tl.zeros([2 * PAIRS, BLOCK_M], dtype=tl.float32)
        for _ in range(K_TILES):
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(tl.load(w_ptrs), x, acc, input_precision=DOT_PREC)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col).to(tl.float32)[:, None]
        qkv_rope_epilogue(
            acc, head, first, rm, m_mask, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
            k_scale_inv, v_scale_inv, stride_cos, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
            stride_vch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAIRS, BLOCK_SIZE, BLOCK_M,
        )  # fmt: skip


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    config: Config | None = None,
    block_m: int | None = None,
    group_n: int = 0,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias); the decoder calls it for M <= MAX_TOKENS (any M computes, in
    row blocks of up to 64). Falls back to cuBLAS when there is no `config` and `config_for` gives none.
    `block_m`: rows of x per program whatever M is (kernels/invariant_gemm.py); None: `block_m_for(M)`.
    `group_n`: > 0 launches the programs in groups of that many weight tiles (`_grouped_tile`; same bits)."""
    n = weight.shape[0]
    config = config or config_for(n, x.shape[1], x.dtype)
    if config is None or not HAVE_TRITON:
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, n, config, gated=False, pdl=pdl, block_m=block_m, group_n=group_n)


def decode_gate_up_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    config: Config | None = None,
    block_m: int | None = None,
    act: int = fk.ACT_SILU,
    group_n: int = 0,
) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) [M, I] for the fused weight [gate; up] ([2I, K], bias [2I]) in one
    kernel; `act` SiLU (the default) or GELU-tanh (fused.ACT_*). Without a `config` (or one from
    `gated_config_for`) it is decode_linear, then act_mul."""
    inter = weight.shape[0] // 2
    config = config or gated_config_for(inter, x.shape[1], x.dtype)
    if config is None or not HAVE_TRITON:
        return fk.act_mul(decode_linear(x, weight, bias, pdl=pdl), pdl=pdl, act=act)
    return _launch(x, weight, bias, inter, config, gated=True, pdl=pdl, block_m=block_m, act=act, group_n=group_n)


def decode_qkv_rope_write(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
    config: Config | None = None,
    linear_config: Config | None = None,
    block_m: int | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q [M, H, D] of x @ qkv^T (+ bias) with rotary at `positions`; k (rotated) and v written into the paged
    caches at `slot_mapping`. For models without q/k norms. A shape `rope_config_for` refuses takes the two
    launches (decode_linear, then fused.qkv_rope_write), which compute the same bits. `config`, `linear_config`
    (the two launches' GEMM) and `block_m` override the defaults (kernels/invariant_gemm.py). `kv_scale`:
    (k_scale, v_scale) of an e4m3 cache (kernels/attention.py)."""
    m, k = x.shape
    head_dim = cos_table.shape[-1]
    config = config or rope_config_for(num_heads, num_kv_heads, head_dim, k, x.dtype)
    if config is None or not HAVE_TRITON:
        qkv = decode_linear(x, weight, bias, pdl=pdl, config=linear_config, block_m=block_m)
        return fk.qkv_rope_write(
            qkv, positions, cos_table, sin_table, None, None, 0.0, num_heads, num_kv_heads,
            k_cache, v_cache, slot_mapping, pdl=pdl, kv_scale=kv_scale,
        )  # fmt: skip
    n = (num_heads + 2 * num_kv_heads) * head_dim
    assert weight.shape == (n, k) and x.stride(1) == 1 and weight.stride(1) == 1
    q = torch.empty(m, num_heads, head_dim, device=x.device, dtype=x.dtype)
    if m == 0:
        return q
    block_n, block_k, num_warps, num_stages = config
    block_m = block_m or block_m_for(m)
    _qkv_rope_gemm_kernel[(n // block_n, triton.cdiv(m, block_m))](
        x,
        weight,
        bias if bias is not None else weight,
        M=m,
        stride_xm=x.stride(0),
        stride_wn=weight.stride(0),
        K_TILES=k // block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        DOT_PREC=dot_precision(x.dtype, None),
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **rope_epilogue_args(positions, cos_table, sin_table, slot_mapping, q, k_cache, v_cache, num_kv_heads, kv_scale),
    )
    return q


def rope_epilogue_args(
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_kv_heads: int,
    kv_scale: tuple[float, float],
) -> dict:
    """The launch arguments of `qkv_rope_epilogue`'s parameters, by name, for a kernel that calls it (this file's
    bf16 kernel, quant/small_step.py's FP8 one): q [M, H, D] is the output."""
    head_dim = q.shape[2]
    assert cos_table.stride(-1) == 1 and cos_table.stride() == sin_table.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.dtype == v_cache.dtype
    return dict(
        pos_ptr=positions,
        cos_ptr=cos_table,
        sin_ptr=sin_table,
        slot_ptr=slot_mapping,
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        k_scale_inv=1.0 / kv_scale[0],
        v_scale_inv=1.0 / kv_scale[1],
        stride_cos=cos_table.stride(0),
        stride_kcb=k_cache.stride(0),
        stride_kcs=k_cache.stride(1),
        stride_kch=k_cache.stride(2),
        stride_vcb=v_cache.stride(0),
        stride_vcs=v_cache.stride(1),
        stride_vch=v_cache.stride(2),
        NUM_HEADS=q.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAIRS=ROPE_PAIRS,
        BLOCK_SIZE=k_cache.shape[1],
    )


def _launch(
    x, weight, bias, n: int, config: Config, gated: bool, pdl: bool, block_m: int | None = None, act: int = 0,
    group_n: int = 0,
) -> torch.Tensor:  # fmt: skip
    """out [M, n]: the first n rows of `weight` (gated: paired with the n rows after them)."""
    m, k = x.shape
    assert weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    block_n, block_k, num_warps, num_stages = config
    assert n % block_n == 0 and k % block_k == 0, f"N={n} K={k} do not tile by {block_n}/{block_k}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be contiguous"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    block_m = block_m or block_m_for(m)
    tiles = (n // block_n, triton.cdiv(m, block_m))
    _decode_gemm_kernel[(tiles[0] * tiles[1],) if group_n else tiles](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K_TILES=k // block_k,
        HAS_BIAS=bias is not None,
        GATED=gated,
        ACT=act,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        DOT_PREC=dot_precision(x.dtype, None),
        GROUP_N=group_n,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out
