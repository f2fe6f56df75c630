"""Triton kernels for paged attention on CUDA; same conventions as the torch reference in `attention.py`.

  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (last dim contiguous)
  slot_mapping[T]: flat slot (block * block_size + offset); padding rows point into scratch block 0
  context_lens[B]: tokens in the cache *including* this step's
  block_tables[B, max_blocks]: block ids of each sequence, in order
  sliding_window: 0, or W: the row at position p sees only keys at positions > p - W
  sinks: None, or [num_heads]: a logit per head in the softmax denominator that adds no value (gpt-oss); added
    once, where the denominator is final (the one-split decode, the reduce, the prefill epilogue)
  softcap: None, or C: scores become C * tanh(scores / C) before masking (Gemma 2); the kernels then take
    scale / C as their score scale and C * log2(e) as the cap (SOFTCAP), so it costs one tanh per score
  k_scale, v_scale: an e4m3 cache (`--kv-cache-dtype fp8`) holds K / k_scale and V / v_scale (per-tensor host
    floats, 1.0 unless the checkpoint has calibrated ones). The kernels widen each K/V tile to q's dtype right
    after its load and fold the scales into the softmax scale (K) and the final normalisation (V), so the
    inner loop is the bf16 one plus a convert; the cache's bytes per token are halved.

Three public entry points:
  write_kv                 scatter this step's K/V rows into the cache (one launch for K and V)
  paged_decode_attention   one query row per sequence; split-K over the context ("flash-decoding"),
                           then a small log-sum-exp reduction kernel
  paged_prefill_attention  ragged causal attention of T query rows (chunked prefill, mixed batches)

Everything the launches depend on is derived from host-side Python ints (shapes, optional hints), never
from device tensors, so decode and prefill are CUDA-graph capturable.

GQA: every program handles all `group = num_heads // num_kv_heads` query heads of one KV head, so each K/V
tile is loaded once per group. Query heads are folded into the M dimension of the tensor-core dots
(decode: the group, padded to 16 rows; prefill: query positions x group).

Softmax runs in the log2 domain (exp2) with fp32 accumulators. For fp32 inputs every `tl.dot` uses
input_precision="ieee" (no tf32), so fp32 results track the reference to ~1e-6.

The module imports without triton (CPU CI): `HAVE_TRITON` says whether the kernels exist.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .common import HAVE_TRITON, cdiv, dot_precision, next_pow2, require_triton, tl, triton

if HAVE_TRITON:
    from .common import to_kv_cache
    from .fused import tanh
    from .pdl import pdl_wait_and_release

__all__ = [
    "HAVE_TRITON",
    "write_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "decode_num_splits",
    "decode_workspace_numel",
]

LOG2E = 1.4426950408889634
DEFAULT_MAX_NUM_SPLITS = 32



def _block_d(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 132  # interpreter runs on CPU tensors: pretend H100/H200 so the split logic is exercised


def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _sm_count(None)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------------------------------------
# Fixed launch configurations (no autotuning: graph-safe and deterministic).
# --------------------------------------------------------------------------------------------------------


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(TILE_N tokens per KV tile, num_warps, num_stages)."""
    row_bytes = _block_d(head_dim) * (4 if dtype == torch.float32 else 2)
    if row_bytes <= 256:  # bf16/fp16 with D <= 128, fp32 with D <= 64
        # Within 2% of the best of tile 32-128 x stages 2-4 x warps 4/8 at W1's (B=32, ctx 768) and W2's
        # (B=1000, ctx 600: 578 us, 97% of HBM) decode shapes on the H200; 2 stages gained ~1% there but
        # lost 7% at B=256, ctx 512 (`benchmarks/gpu_kernels.py --sweep`, benchmarks/README.md).
        return 64, 4, 3
    if row_bytes <= 512:
        return 32, 4, 3
    return 16, 4, 2


def _reduce_warps(elements: int) -> int:
    """Warps per program of the split-K reduce, which combines `elements` = splits x head_dim partial values.

    One warp up to 1,024: on the H200, W1 async (B = 32, 4 splits x 128) ran 1.0% faster than with 2 warps and
    1.8% faster than with 4 in one process (benchmarks/README.md). Under PDL these programs sit on the SMs
    waiting for the split kernel, and the O projection's programs can only be placed once they have all
    started, so the smaller they are the better."""
    return max(1, min(4, elements // 1024))


# Shared memory the pipelined prefill tile (bf16/fp16, D <= 128, 5 stages) takes: 132,096 bytes compiled for sm_90.
PIPELINED_PREFILL_SMEM = 132_096


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may use on this device (0 without CUDA: the interpreter)."""
    if not torch.cuda.is_available():
        return 0
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def _device_shared_memory(device: torch.device | None) -> int:
    if device is None or device.type != "cuda":
        return 0
    return _max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def _prefill_config(
    head_dim: int, dtype: torch.dtype, device: torch.device | None = None
) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for full-size query tiles."""
    # Checked by compiling for sm_90 (ptxas -v): no register spills except fp32 D=128 (~90 B, FMA dots).
    bd = _block_d(head_dim)
    if bd >= 512:
        # The latent cache read as one shared head (kv_lora 512 + rope 64 = 576, padded to 1,024): the Q tile and
        # the staged K and V tiles must fit the H100/H200's 227 KiB of shared memory. (64, 32, 8, 2) asked 384 KiB
        # there and failed to compile (DeepSeek-V2-Lite's W1, 2026-12-06); 16 x 16 tiles take about 160 KiB in
        # bf16 with 2 stages, 192 KiB in fp32 with 1 (prefill_shared_memory).
        return (16, 16, 8, 1) if dtype == torch.float32 else (16, 16, 8, 2)
    if dtype == torch.float32:  # fp32 "ieee" dots run on FMA units: keep register tiles small
        if bd <= 64:
            return 64, 32, 8, 2
        if bd <= 128:
            return 32, 16, 4, 2
        return 16, 16, 4, 2
    if bd <= 64:
        return 128, 64, 8, 3
    if bd <= 128:
        # wgmma, ~185 regs. Each K/V tile's addresses come from a page-table load, and Triton's pipeliner spends
        # a stage on that load: with 3 stages it issues tile t+1's K/V only after computing tile t and waits for
        # all of it (`cp.async.wait_group 0`, PTX for sm_90), so nothing overlaps. 5 stages keep one tile in
        # flight during the compute: on the H200, 9 prompts of 100-1,024 tokens 162 -> 156 us, W2 41.7 -> 41.5 ms
        # per step, outputs bit-equal (benchmarks/README.md, "Pipelined attention loops"). 129 KiB of shared
        # memory: GPUs with less (sm_86/89: 99 KiB) keep 3 stages (96 KiB).
        if _device_shared_memory(device) >= PIPELINED_PREFILL_SMEM:
            return 128, 64, 8, 5
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def prefill_shared_memory(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of shared memory `_prefill_config`'s tile asks for, as Triton stages it: the Q tile once, the K and V
    tiles once per stage (an estimate for the sizing test; the compiler adds a little for the page-table loads)."""
    block_m, block_n, _, stages = _prefill_config(head_dim, dtype)
    elem = 4 if dtype == torch.float32 else 2
    bd = _block_d(head_dim)
    return (block_m * bd + 2 * stages * block_n * bd) * elem


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_context_len: int,
    max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    device: torch.device | None = None,
) -> int:
    """How many context splits the decode kernel uses; host-side ints only (graph-safe).

    Aim for about 4 programs per SM, rounded up to a power of two; never more splits than KV tiles in
    `max_context_len` (an upper bound: the kernel splits each sequence's *actual* context evenly over
    the splits, so a generous bound costs only a few idle programs).

    The split count changes the fp32 summation order, so it must not change with the batch's make-up where
    sync and async steps differ: 2 programs per SM (2 splits at W1's B=32 x 8 KV heads, 31.4 us on the
    H200 vs 33.9) made graph+async and eager+sync greedy outputs agree on only 97.5% of tokens
    (test_engine_gpu.py), because the count then fell below the context-tile cap for mid-sized batches.
    A split size fixed per sequence (splits = its context / a constant) would be batch-invariant and is
    the way to take that gain.
    """
    tile_n = _decode_config(head_dim, dtype)[0]
    sms = _device_sm_count(device) if device is not None else _sm_count(None)
    programs = max(1, num_seqs * num_kv_heads)
    want = next_pow2(cdiv(4 * sms, programs))
    max_tiles = max(1, cdiv(max(1, max_context_len), tile_n))
    return max(1, min(want, max_num_splits, max_tiles))


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the split-K workspace: partial outputs [B, H, S, D] then log-sum-exps [B, H, S]."""
    if num_splits <= 1:
        return 0
    return num_seqs * num_heads * num_splits * (head_dim + 1)


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------

if HAVE_TRITON:

    def _jit_unspecialized(ints: list[str], pointers: list[str]):
        """triton.jit compiling one variant whatever the values of `ints` and the alignment of `pointers`."""
        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
            return triton.jit(do_not_specialize=ints, do_not_specialize_on_alignment=pointers)
        return triton.jit(do_not_specialize=[*ints, *pointers])  # Triton 3.1 (torch 2.5) has no alignment switch

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        k_scale_inv,
        v_scale_inv,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)  # padding rows write the scratch block: no skip branch
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
        tl.store(k_dst, to_kv_cache(k, k_scale_inv, k_cache_ptr, key_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, to_kv_cache(v, v_scale_inv, v_cache_ptr, value_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_rows(ptrs, valid, d_mask, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
        """A [rows, BLOCK_D] tile; masked rows and padded head-dim columns read as 0 (unmasked: no mask at all)."""
        if MASK_ROWS:
            if MASK_D:
                x = tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)
            else:
                x = tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            if MASK_D:
                x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
            else:
                x = tl.load(ptrs)
        return x

    @triton.jit
    def _attend_kv_tile(
        q,
        m_i,
        l_i,
        acc,
        pos,
        kv_end,
        q_pos,
        bt_row,
        k_base,
        v_base,
        d,
        d_mask,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        scale_log2,
        window,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        MASK_TAIL: tl.constexpr,
        CAUSAL: tl.constexpr,
        SLIDING: tl.constexpr,
        DOT_PREC: tl.constexpr,
        softcap_log2=1.0,
        SOFTCAP: tl.constexpr = False,
        limit=None,
    ):
        """One online-softmax step of the rows `q` over the KV positions `pos` of a paged sequence.

        MASK_TAIL: positions at or past `kv_end` are not read and score -inf. CAUSAL: position p is visible to
        row r only if p <= limit[r] (`limit`: the last key each row sees, q_pos where None; a bidirectional image's
        rows see to their image's end), which also hides the tail when kv_end - 1 is the largest limit, and a
        row that sees nothing yet keeps a finite running max. SLIDING (with CAUSAL): p must also be
        > q_pos[r] - window, and the tail is hidden explicitly (kv_end may then sit below q_pos).
        Returns the updated (m_i, l_i, acc).
        """
        valid = pos < kv_end
        if MASK_TAIL:
            page = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        in_page = pos % BLOCK_SIZE
        k_ptrs = k_base + page[:, None] * stride_kb + in_page[:, None] * stride_ks + d[None, :]
        # An e4m3 cache's K and V widen to q's dtype (its scales are folded into scale_log2 and the output), or,
        # under a bf16 q, to fp16: e4m3 -> fp16 is one conversion per two values on sm90 and exact, where e4m3 ->
        # bf16 goes through fp32 (the conversions made W2's FP8-KV decode attention slower than bf16's: 7.7 vs 7.1
        # ms a step, H200 2026-12-03f). q and the probabilities then round to fp16 (3 more mantissa bits than
        # bf16; q past 65,504 would not fit, which no model's rotated queries reach).
        compute = q.dtype
        if k_base.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
            compute = tl.float16
        k = _load_rows(k_ptrs, valid, d_mask, MASK_TAIL, HEAD_DIM != BLOCK_D).to(compute)
        s = tl.dot(q.to(compute), tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if SOFTCAP:  # scale_log2 is scale / cap here: cap * tanh(scores / cap), in log2 units
            s = tanh(s) * softcap_log2
        if CAUSAL:
            if limit is None:
                keep = pos[None, :] <= q_pos[:, None]
            else:
                keep = pos[None, :] <= limit[:, None]
            if SLIDING:
                keep = keep & (pos[None, :] > q_pos[:, None] - window) & valid[None, :]
            s = tl.where(keep, s, float("-inf"))
        elif MASK_TAIL:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if CAUSAL:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet (padding)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + page[:, None] * stride_vb + in_page[:, None] * stride_vs + d[None, :]
        v = _load_rows(v_ptrs, valid, d_mask, MASK_TAIL, HEAD_DIM != BLOCK_D).to(compute)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _add_sink(l_i, m_i, sinks_ptr, heads, mask, HAS_SINKS: tl.constexpr):
        """The softmax denominator `l_i` (relative to the running max `m_i`, log2 units) plus each head's sink
        term exp(sink - max): a logit that takes probability and adds no value (gpt-oss)."""
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - m_i)
        return l_i

    @triton.jit
    def _decode_split_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        scale_log2,
        v_scale,
        window,
        num_heads,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        sinks_ptr,
        NUM_SPLITS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        USE_PDL: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        softcap_log2=1.0,
        SOFTCAP: tl.constexpr = False,
        KV_FP8: tl.constexpr = False,
    ):
        pdl_wait_and_release(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(context_lens_ptr + b)
        # The query (position ctx - 1) sees keys [lo, ctx): all of them, or the last `window`.
        lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        # Split that range evenly (in whole tiles) over the NUM_SPLITS programs; trailing splits of short
        # sequences get an empty range and report lse = -inf.
        tiles_per_split = tl.cdiv(tl.cdiv(ctx - lo, TILE_N), NUM_SPLITS)
        start = lo + split * tiles_per_split * TILE_N
        end = tl.minimum(start + tiles_per_split * TILE_N, ctx)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, BLOCK_D)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kvh * GROUP + g
        b64 = b.to(tl.int64)
        q = tl.load(
            q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)

        bt_row = block_tables_ptr + b64 * stride_bt
        k_base = k_cache_ptr + kvh * stride_kh
        v_base = v_cache_ptr + kvh * stride_vh
        offs_n = tl.arange(0, TILE_N)
        for n0 in range(start, end, TILE_N):
            m_i, l_i, acc = _attend_kv_tile(
                q, m_i, l_i, acc, n0 + offs_n, end, end, bt_row, k_base, v_base, d, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, True, False, False, DOT_PREC,  # MASK_TAIL, CAUSAL, SLIDING
                softcap_log2, SOFTCAP,
            )  # fmt: skip

        has = l_i > 0.0
        denom = l_i
        if NUM_SPLITS == 1:  # with splits, the reduce adds the sink once
            denom = _add_sink(denom, m_i, sinks_ptr, heads, g_mask, HAS_SINKS)
        o = acc / tl.where(has, denom, 1.0)[:, None]
        if KV_FP8:  # V was read unscaled: P @ (V_fp8 * v_scale) = (P @ V_fp8) * v_scale
            o = o * v_scale
        o = tl.where(has[:, None], o, 0.0)
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None] & d_mask[None, :],
            )
        else:
            # workspace rows: ((b * H + head) * NUM_SPLITS + split)
            row = (b64 * num_heads + heads) * NUM_SPLITS + split
            tl.store(
                part_o_ptr + row[:, None] * HEAD_DIM + d[None, :],
                o,
                mask=g_mask[:, None] & d_mask[None, :],
            )
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=g_mask)

    @triton.jit
    def _decode_reduce_kernel(
        part_o_ptr,
        part_lse_ptr,
        out_ptr,
        num_heads,
        stride_ob,
        stride_oh,
        sinks_ptr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        USE_PDL: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        pdl_wait_and_release(USE_PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < NUM_SPLITS
        d_mask = d < HEAD_DIM
        row = (b * num_heads + h) * NUM_SPLITS + s
        lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2(e): lse is in log2 units
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # 0 for empty splits
        denom = tl.sum(w, 0)
        if HAS_SINKS:
            denom += tl.exp2(sink - m)
        o = tl.load(
            part_o_ptr + row[:, None] * HEAD_DIM + d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_mask)

    # NOTE: Triton compiles a variant per "divisible by 16" class of each int argument and per 16-byte alignment
    # of each pointer. The batch-dependent ones here (the sequence and token counts, and the metadata rows that a
    # mixed step's decode split slices off) would make a new variant the first time a step's counts or split
    # fall in a new class: a 1.4 s compile inside a measured W1 step on the H200. They are scalar loads and
    # bounds, so specialising on them buys nothing.
    @_jit_unspecialized(
        ints=["num_seqs", "num_tokens"],
        pointers=["block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr", "key_limits_ptr"],  # key_limits_ptr is
        # context_lens_ptr where a step has no key limits: sliced the same way
    )
    def _prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        cu_seqlens_ptr,
        context_lens_ptr,
        out_ptr,
        scale_log2,
        v_scale,
        window,
        num_seqs,
        num_tokens,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        sinks_ptr,
        GROUP: tl.constexpr,
        Q_PER_TILE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SLIDING: tl.constexpr,
        DOT_PREC: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        ONE_PATH: tl.constexpr = False,  # batch-invariant: every KV tile through the masked loop (phase 2)
        softcap_log2=1.0,
        SOFTCAP: tl.constexpr = False,
        KV_FP8: tl.constexpr = False,
        key_limits_ptr=None,
        HAS_LIMITS: tl.constexpr = False,
    ):
        pid_q = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)

        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        qi = r // GROUP  # query position inside the tile
        g = r % GROUP  # head inside the group
        heads = kvh * GROUP + g
        d_mask = d < HEAD_DIM
        row_in_tile = qi < Q_PER_TILE

        if b >= num_seqs:
            # The extra "sequence": zero the rows past cu_seqlens_q[B] (padding of a graph bucket), so
            # every element of `out` is written, like the reference's zeros_like.
            tail = tl.load(cu_seqlens_ptr + num_seqs)
            step = tl.num_programs(0) * Q_PER_TILE
            zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
            for t0 in range(tail + pid_q * Q_PER_TILE, num_tokens, step):
                tok = (t0 + qi).to(tl.int64)
                m = row_in_tile & (tok < num_tokens)
                tl.store(
                    out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                    zero,
                    mask=m[:, None] & d_mask[None, :],
                )
            return

        tile = tl.num_programs(0) - 1 - pid_q  # longest (last) query tiles first: better tail balance
        q_start = tl.load(cu_seqlens_ptr + b)
        q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
        tile_q0 = tile * Q_PER_TILE
        if tile_q0 >= q_len:
            return
        ctx = tl.load(context_lens_ptr + b)

        q_local = tile_q0 + qi
        row_valid = row_in_tile & (q_local < q_len)
        q_pos = ctx - q_len + q_local  # absolute position of each row in its sequence
        tok = (q_start + q_local).to(tl.int64)
        io_mask = row_valid[:, None] & d_mask[None, :]
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=io_mask,
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        first_pos = ctx - q_len + tile_q0
        last_local = tl.minimum(tile_q0 + Q_PER_TILE, q_len) - 1
        kv_end = tl.maximum(ctx - q_len + last_local + 1, 0)  # keys past this are masked for every row
        # Every row sees the keys in [full_lo, full_end): above the window of the last row, at or below
        # the first row. The unmasked phase covers whole tiles of that range from full_lo.
        full_lo = 0
        if SLIDING:
            full_lo = tl.minimum(tl.maximum(kv_end - window, 0), kv_end)
        full_end = full_lo + (tl.maximum(first_pos + 1 - full_lo, 0) // BLOCK_N) * BLOCK_N
        full_end = tl.minimum(full_end, kv_end)
        # Key limits (a bidirectional image's rows see to the image's end, past their own position): each row's
        # causal bound, at least its position; the masked phase then runs to the tile's largest. Every row still
        # sees the keys up to first_pos, so phases 0 and 1 stay as they are.
        limit = q_pos
        if HAS_LIMITS:
            limit = tl.maximum(tl.load(key_limits_ptr + tok, mask=row_valid, other=0).to(q_pos.dtype), q_pos)
            kv_end = tl.maximum(kv_end, tl.max(tl.where(row_valid, limit + 1, 0), 0))
        if ONE_PATH:
            # NOTE: the unmasked loop may contract `score * scale - max` into one FMA where the masked one cannot
            # (a select sits between them), so a key scored in phase 1 under one query tiling and in phase 2 under
            # another could round differently. One path for every tile: the tiling no longer matters.
            full_end = full_lo

        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kvh * stride_kh
        v_base = v_cache_ptr + kvh * stride_vh
        offs_n = tl.arange(0, BLOCK_N)

        # Phase 0 (sliding window): keys below full_lo, seen by some rows only; the first row's window
        # starts at first_pos - window + 1.
        if SLIDING:
            for n0 in range(tl.maximum(first_pos - window + 1, 0), full_lo, BLOCK_N):
                m_i, l_i, acc = _attend_kv_tile(
                    q, m_i, l_i, acc, n0 + offs_n, full_lo, q_pos, bt_row, k_base, v_base, d, d_mask,
                    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window,
                    HEAD_DIM, BLOCK_D, BLOCK_SIZE, True, True, True, DOT_PREC,  # MASK_TAIL, CAUSAL, SLIDING
                    softcap_log2, SOFTCAP, limit,
                )  # fmt: skip
        # Phase 1: KV tiles every row sees; no score masking.
        for n0 in range(full_lo, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_kv_tile(
                q, m_i, l_i, acc, n0 + offs_n, full_end, q_pos, bt_row, k_base, v_base, d, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, False, False, False, DOT_PREC,  # MASK_TAIL, CAUSAL, SLIDING
                softcap_log2, SOFTCAP,
            )  # fmt: skip
        # Phase 2: tiles crossing the causal diagonal; mask key > row position (and keys out of a window).
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_kv_tile(
                q, m_i, l_i, acc, n0 + offs_n, kv_end, q_pos, bt_row, k_base, v_base, d, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window,
                HEAD_DIM, BLOCK_D, BLOCK_SIZE, True, True, SLIDING, DOT_PREC,  # MASK_TAIL, CAUSAL, SLIDING
                softcap_log2, SOFTCAP, limit,
            )  # fmt: skip

        has = l_i > 0.0
        denom = _add_sink(l_i, m_i, sinks_ptr, heads, row_valid, HAS_SINKS)
        o = acc / tl.where(has, denom, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        o = tl.where(has[:, None], o, 0.0)
        tl.store(
            out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


# --------------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "caches must be [num_blocks, block_size, KVH, D]"
    )
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert k_cache.dtype == v_cache.dtype, f"K cache {k_cache.dtype}, V cache {v_cache.dtype}"
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    assert block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}"
    return block_size, num_kv_heads, head_dim


def _attention_strides(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The stride arguments of the decode and prefill kernels, in their order (the last dims are contiguous)."""
    return (
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
    )


def _score_scale(scale: float, softcap: float | None) -> float:
    """What the kernels multiply q.k by: scale in log2 units, or scale / cap under soft-capping (the cap's
    tanh comes first, then cap * log2(e))."""
    return float(scale) / softcap if softcap is not None else float(scale) * LOG2E


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, KVH, D] (any row/head strides) into the paged caches at slot_mapping[:T]. An e4m3 cache
    stores key / k_scale and value / v_scale, saturated (attention.to_cache); other caches ignore the scales."""
    require_triton("kernels.attention (use worker.engine.attention on CPU)")
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    assert key.shape == (num_tokens, num_kv_heads, head_dim) and value.shape == key.shape
    assert slot_mapping.shape[0] >= num_tokens
    if num_tokens == 0:
        return
    key = _last_dim_contiguous(key)
    value = _last_dim_contiguous(value)
    block_h = next_pow2(num_kv_heads)
    block_d = next_pow2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    max_context_len: int | None = None,
    sliding_window: int = 0,
    pdl: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query row per sequence: q [B, H, D] at position context_lens[b] - 1 (seeing the last
    `sliding_window` keys when that is not 0). Returns [B, H, D]. `sinks` [H]: each head's sink logit.

    Sequences with context_lens 0 get zeros. `max_context_len` (host int, optional) only caps the number of
    splits (default bound: block_tables.shape[1] * block_size); results are correct even if a sequence is
    longer, since each program splits its sequence's actual context on the device. For CUDA graphs pass the
    model's max length at capture so the baked-in split count suits any context. With more than one split, an
    fp32 workspace of `decode_workspace_numel(...)` elements is allocated (its size depends on host ints only).
    An e4m3 cache (`--kv-cache-dtype fp8`) is read as K * k_scale and V * v_scale (host floats, per tensor).
    """
    require_triton("kernels.attention (use worker.engine.attention on CPU)")
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_seqs, num_heads, q_dim = q.shape
    assert q_dim == head_dim, f"q head_dim {q_dim} != cache head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.shape[0] >= num_seqs and context_lens.shape[0] >= num_seqs
    assert block_tables.stride(-1) == 1, "block_tables rows must be contiguous"
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    tile_n, num_warps, num_stages = _decode_config(head_dim, q.dtype)
    bound = block_tables.shape[1] * block_size
    if max_context_len is not None:
        bound = min(bound, max_context_len)
    if sliding_window:
        bound = min(bound, sliding_window)  # no query reads more keys than its window
    num_splits = decode_num_splits(
        num_seqs, num_kv_heads, head_dim, q.dtype, bound, max_num_splits=max_num_splits, device=q.device
    )
    block_d = _block_d(head_dim)

    if num_splits > 1:
        workspace_numel = decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits)
        workspace = torch.empty(workspace_numel, dtype=torch.float32, device=q.device)
        n_o = num_seqs * num_heads * num_splits * head_dim  # partial outputs first, then the log-sum-exps
        part_o = workspace[:n_o]
        part_lse = workspace[n_o:]
    else:
        part_o = part_lse = out  # unused

    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_o,
        part_lse,
        _score_scale(float(scale) * k_scale, softcap),  # q . (K_fp8 * k_scale) = (q . K_fp8) * k_scale
        float(v_scale),
        sliding_window,
        num_heads,
        *_attention_strides(q, out, k_cache, v_cache, block_tables),
        out if sinks is None else sinks,  # never read without HAS_SINKS
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        DOT_PREC=dot_precision(q.dtype, "tf32"),
        USE_PDL=pdl,
        HAS_SINKS=sinks is not None,
        softcap_log2=(softcap or 1.0) * LOG2E,
        SOFTCAP=softcap is not None,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o,
            part_lse,
            out,
            num_heads,
            out.stride(0),
            out.stride(1),
            out if sinks is None else sinks,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            USE_PDL=pdl,
            HAS_SINKS=sinks is not None,
            num_warps=_reduce_warps(block_d * next_pow2(num_splits)),
            launch_pdl=pdl,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tiles_by_step: bool = False,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal attention of q [T, H, D] over the paged cache (each row within the last
    `sliding_window` keys when that is not 0). Returns [T, H, D]. `sinks` [H]: each head's sink logit.
    `key_limits` [T] (int): the last key position each row sees, where that is past its own (a Gemma 3 image's rows
    see their whole image, as attention.py's reference reads it); None: causal.

    B = len(context_lens). Row j of sequence b sits at position context_lens[b] - q_len_b + j. Rows past
    cu_seqlens_q[B] and sequences with context_lens 0 get zeros. `max_query_len` (host int, optional) must be
    >= the longest q_len (rows past it are not computed): it sizes the grid and picks smaller query tiles
    for decode-heavy batches; without it the grid is sized for T rows per sequence (correct, but many
    programs exit at once).

    `batch_invariant`: one query tile shape and warp count whatever the step (no shrinking for decode-heavy
    steps) and one code path for every KV tile (the masked one), so a row's arithmetic depends only on its own
    position and the cache: its KV tiles are aligned from position 0 and visited in order, tiles past it add
    exact zeros, and its tile-mates change nothing. Chunked or whole, cached prefix or not, one row or
    many: the same bits (deterministic.py). Not with a sliding window: its first tiles start at the tile's
    first row. `tiles_by_step` (with `batch_invariant`): the query tile shrinks for decode-heavy steps as in the
    default mode; a row's bits then also depend on whether the tile shape changes them, which
    deterministic.query_tiles_agree checks on the device before it is turned on.

    An e4m3 cache is read as K * k_scale and V * v_scale, as in `paged_decode_attention`.
    """
    require_triton("kernels.attention (use worker.engine.attention on CPU)")
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_tokens, num_heads, q_dim = q.shape
    assert q_dim == head_dim, f"q head_dim {q_dim} != cache head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape[0] >= num_seqs + 1 and block_tables.shape[0] >= num_seqs
    assert block_tables.stride(-1) == 1, "block_tables rows must be contiguous"
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _prefill_config(head_dim, q.dtype, q.device)
    max_q = num_tokens if max_query_len is None else max(1, min(max_query_len, num_tokens))
    if not batch_invariant or tiles_by_step:
        # Decode-heavy batches: shrink the M tile to what the longest sequence needs (min 16 rows for tl.dot).
        block_m = min(block_m, max(16, next_pow2(max_q * group)))
        block_m = max(block_m, next_pow2(group))
        if block_m <= 32:
            num_warps = min(num_warps, 4)
    q_per_tile = block_m // group
    n_q_tiles = cdiv(max_q, q_per_tile)

    _prefill_kernel[(n_q_tiles, num_seqs + 1, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        _score_scale(float(scale) * k_scale, softcap),  # q . (K_fp8 * k_scale) = (q . K_fp8) * k_scale
        float(v_scale),
        sliding_window,
        num_seqs,
        num_tokens,
        *_attention_strides(q, out, k_cache, v_cache, block_tables),
        out if sinks is None else sinks,  # never read without HAS_SINKS
        GROUP=group,
        Q_PER_TILE=q_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        SLIDING=sliding_window > 0,
        DOT_PREC=dot_precision(q.dtype, "tf32"),
        HAS_SINKS=sinks is not None,
        ONE_PATH=batch_invariant,
        softcap_log2=(softcap or 1.0) * LOG2E,
        SOFTCAP=softcap is not None,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        key_limits_ptr=context_lens if key_limits is None else key_limits,  # never read without HAS_LIMITS
        HAS_LIMITS=key_limits is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
