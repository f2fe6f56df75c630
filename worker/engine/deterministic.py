"""Deterministic mode (EngineConfig.deterministic): the kernels with which a request's tokens are bitwise the same
alone or in any batch. Owns nothing; the runner and the decoder ask it for their attention backend and layer ops.

A row's arithmetic must depend only on its own token, its position and the KV cache, never on the step: not on
the batch size, the step's longest context, graph or eager, how a prompt was chunked (`--max-num-batched-tokens`),
whether a prefix came from the cache, or whether the token was computed with the prompt or as a decode. Every
reduction whose order could follow the step is therefore fixed:

  weight GEMMs   CUDA: one Triton kernel with one K reduction order for every M (kernels/invariant_gemm.py),
                 small tiles for decode-sized steps and large ones for large steps where the build-time
                 check finds the same bits, never cuBLAS. CPU: one F.linear per row (`row_linear`): torch's CPU GEMMs in fp32 gave
                 different bits for a row at M = 1 and M = 40 (bf16 agreed on this machine, but nothing
                 promises it), so each row takes the same M = 1 call wherever it sits.
  attention      one kernel for every row, prompt or decode: CUDA, the varlen prefill kernel with one path over
                 KV tiles aligned from position 0 (kernels/attention.py `batch_invariant`), so the reduction
                 order over keys depends only on the row's position; the split-K decode kernel (whose split
                 count follows the batch) is not used. Its query tile shrinks for decode-heavy steps as in the
                 default mode (and a mixed step's leading decodes get a launch of their own) only where
                 `query_tiles_agree` finds, at start, that no tile changes a row's bits; else one tile for
                 every step. A token computed inside a prompt chunk and the same token
                 computed as a decode, or recomputed after a preemption, or read back from the prefix cache,
                 then have the same bits. CPU: the torch reference, one row at a time over exactly its
                 visible keys (`RowAttentionBackend`).
  row-local      RMSNorm (one program or torch reduction per row), rotary, SiLU·mul, the embedding, the final
                 norm, log-softmax and sampling (per row; the random stream depends on (seed, token index))
                 already compute each row alone: unchanged.

What does not hold yet: sliding-window layers on CUDA (the prefill kernel's first window tile starts at the query
tile's first row), the torch attention backend on CUDA (EngineConfig.attention_backend "torch"), and a different
tensor-parallel size (the all-reduce order changes with it; each size is batch-invariant on its own at 1 and 2
ranks, whose all-reduce adds two values; above 2 the order follows the step's size, so the sharded path refuses it). The price: decode attention loses split-K and large steps lose
cuBLAS; `bench engine --deterministic` measures it.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

from .attention import paged_attention_ref
from .attention_backend import AttentionBackend, AttentionMetadata, TritonAttentionBackend
from .layer_ops import ACT_CODES, ACTIVATIONS, NORMS, LayerOps, gate_up_then_act

logger = logging.getLogger("cbq.engine")


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias), one M = 1 product per row (the CPU's batch-invariant GEMM). Each row is
    copied into a fresh tensor, so its alignment does not follow its place in x either."""
    rows = [F.linear(x[i : i + 1].clone(), weight, bias) for i in range(x.shape[0])]
    if not rows:
        return x.new_empty(0, weight.shape[0])
    return torch.cat(rows)


class RowAttentionBackend(AttentionBackend):
    """The torch reference, one query row at a time over exactly the keys it sees (CPU, tests)."""

    name = "torch-rows"

    def attend(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale, layer_idx, pdl=False, softcap=None, sinks=None
    ):
        out = torch.zeros_like(q)
        cu = meta.cu_seqlens_q.tolist()
        ctx = meta.context_lens.tolist()
        one_row = torch.tensor([0, 1], dtype=meta.cu_seqlens_q.dtype)
        for b, ctx_len in enumerate(ctx):
            q_start, q_end = cu[b], cu[b + 1]
            for t in range(q_start, q_end):
                position = ctx_len - (q_end - q_start) + (t - q_start)
                out[t : t + 1] = paged_attention_ref(
                    q[t : t + 1].clone(),
                    k_cache,
                    v_cache,
                    meta.block_tables[b : b + 1],
                    one_row,
                    torch.tensor([position + 1]),
                    scale,
                    sliding_window=meta.sliding_window(layer_idx),
                    softcap=softcap,
                    sinks=sinks,
                    k_scale=meta.kv_scale(layer_idx)[0],
                    v_scale=meta.kv_scale(layer_idx)[1],
                )
        return out


class InvariantTritonBackend(TritonAttentionBackend):
    """Every row of every step through the varlen prefill kernel with one path over KV tiles aligned from 0 (CUDA).
    `tiles_by_step`: the query tile shrinks for decode-heavy steps (16 rows for Llama's 4-head groups instead of
    128), which `query_tiles_agree` found to leave every row's bits unchanged on this device; else one query
    tile for every step."""

    name = "triton"  # capturable like the default Triton backend

    def __init__(self, tiles_by_step: bool = False):
        super().__init__()
        self.tiles_by_step = tiles_by_step

    def attend(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale, layer_idx, pdl=False, softcap=None, sinks=None
    ):
        common = dict(
            sliding_window=meta.sliding_window(layer_idx), sinks=sinks, softcap=softcap, batch_invariant=True,
            k_scale=meta.kv_scale(layer_idx)[0], v_scale=meta.kv_scale(layer_idx)[1], tiles_by_step=self.tiles_by_step,
        )  # fmt: skip
        num_decode, num_seqs = meta.num_decode_seqs, meta.context_lens.shape[0]
        if not self.tiles_by_step or num_decode in (0, num_seqs):
            return self._k.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale,
                max_query_len=meta.max_query_len, **common,
            )  # fmt: skip
        # A mixed step, where the tile may follow the step: its leading decode rows in decode-sized query tiles,
        # the prompt chunks after them in full ones (the default backend splits them the same way).
        out = torch.empty_like(q)
        self._k.paged_prefill_attention(
            q[:num_decode], k_cache, v_cache, meta.block_tables[:num_decode], meta.cu_seqlens_q[: num_decode + 1],
            meta.context_lens[:num_decode], scale, out=out[:num_decode], max_query_len=1, **common,
        )  # fmt: skip
        return self._k.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables[num_decode:], meta.cu_seqlens_q[num_decode:],
            meta.context_lens[num_decode:], scale, out=out, max_query_len=meta.max_query_len, **common,
        )  # fmt: skip


def attention_backend(default: AttentionBackend, k_cache: torch.Tensor, num_heads: int, dtype: torch.dtype):
    """The deterministic twin of the backend the runner picked, for a model with `num_heads` query heads in `dtype`
    whose layer caches are shaped and typed as `k_cache` [blocks, block size, KV heads, head_dim]."""
    if isinstance(default, TritonAttentionBackend):
        tiles_by_step = query_tiles_agree(k_cache, num_heads, dtype)
        if not tiles_by_step:
            logger.warning(
                "deterministic mode: attention keeps one query tile for every step (a smaller one changed bits on "
                "this device): decode steps run slower"
            )
        return InvariantTritonBackend(tiles_by_step=tiles_by_step)
    return RowAttentionBackend()


def query_tiles_agree(k_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> bool:
    """Whether the batch-invariant prefill kernel gives the same bits for the same rows under every query tile
    that the decode-heavy shrink can pick (16 rows up to the full tile, by the step's longest query) as under the
    full tile, on this device, for these shapes. Run once at start on a scratch cache of random keys and values:
    decode rows at contexts that cross KV tiles, a 5-row prompt chunk, and a padding row. The H200 sweep of the
    weight GEMMs found tile shape never changing bits; in attention a row's softmax sum also runs across the
    tile's threads, whose layout follows the tile, so it is checked rather than assumed."""
    from .kernels import attention as at
    from .kernels.common import OutOfResources

    _, block_size, num_kv_heads, head_dim = k_cache.shape
    dev = k_cache.device
    gen = torch.Generator().manual_seed(0)
    contexts = [1, 37, 300, 129, 0]  # the last: a padding sequence
    blocks_per_seq = -(-max(contexts) // block_size)
    cache_shape = (1 + len(contexts) * blocks_per_seq, block_size, num_kv_heads, head_dim)  # block 0: scratch
    k, v = (torch.randn(cache_shape, generator=gen).to(dev, k_cache.dtype) for _ in range(2))
    tables = (1 + torch.arange(len(contexts) * blocks_per_seq)).view(len(contexts), blocks_per_seq).to(dev, torch.int32)
    for q_lens in ([1, 1, 1, 1, 1], [1, 1, 1, 5, 1]):  # decode rows only, then with a 5-row prompt chunk
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dev, dtype)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        args = (q, k, v, tables, cu, torch.tensor(contexts, dtype=torch.int32, device=dev), head_dim**-0.5)
        whole = at.paged_prefill_attention(*args, batch_invariant=True)
        for hint in sorted({max(h, max(q_lens)) for h in (1, 2, 4, 8, 16, 32, 64)}):  # every tile the shrink picks
            try:
                got = at.paged_prefill_attention(*args, max_query_len=hint, batch_invariant=True, tiles_by_step=True)
            except OutOfResources:  # a tile this GPU cannot launch: one tile for every step
                return False
            if not torch.equal(got, whole):
                return False
    return True


def unsupported_reason(is_cuda: bool, sliding_windows: tuple[int, ...], backend: AttentionBackend) -> str | None:
    """Why deterministic mode cannot keep its promise for a model with these layer windows and this attention
    backend here (None: it can)."""
    if is_cuda and not isinstance(backend, TritonAttentionBackend):
        return "the torch attention backend on CUDA has no batch-invariant kernel"
    if is_cuda and any(sliding_windows):
        return "sliding-window layers have no batch-invariant Triton attention yet"
    return None


def check_supported(choice: str, reason: str | None) -> None:
    """Raise ValueError where deterministic mode cannot run a model with `choice` of decoder (`reason`: why the
    owned decoder cannot run the model, decoder.unsupported_reason; None: it can)."""
    if choice == "hf":
        raise ValueError("deterministic mode needs the owned decoder (decoder 'auto' or 'owned'), not 'hf'")
    if reason is not None:
        raise ValueError(
            f"deterministic mode needs the owned decoder, which does not support this model: {reason}"
        )


def layer_ops(owned, pdl: bool):
    """The LayerOps of the owned decoder `owned` for every step size (built here so that the dispatch there
    stays one line). Triton: the invariant GEMMs with their fused epilogues and the row-local Triton
    element-wise kernels, with the family's norm and activation flags. Otherwise the torch references with
    `row_linear` (correct and batch-invariant everywhere, slow on CUDA)."""
    from .kernels import fused as fk
    from .kernels import invariant_gemm

    if owned.is_quantized:  # the invariant GEMMs and row_linear multiply plain weights only
        raise ValueError("deterministic mode runs unquantized weights only, not FP8 or INT4 linears")
    if owned.use_triton:
        weights = {"lm_head": owned.lm_head}
        gated = set()
        for i, w in enumerate(owned.layers):
            weights.update({f"layer {i} qkv": w.qkv_weight, f"layer {i} o": w.o_weight})
            weights.update({f"layer {i} gate_up": w.gate_up_weight, f"layer {i} down": w.down_weight})
            gated.add(f"layer {i} gate_up")
        bad = invariant_gemm.untiled(weights)
        if bad:
            raise ValueError(
                f"deterministic mode: these weights do not tile for the invariant GEMM: {bad[:4]}"
            )
        gemms = invariant_gemm.InvariantGemms.for_weights(weights, gated, pdl=pdl)
        shapes = {(w.shape[0], w.shape[1], name in gated) for name, w in weights.items()}
        fixed = shapes - gemms.large_shapes - gemms.small_by_m
        (logger.warning if fixed else logger.info)(
            "deterministic mode: large GEMM tiles for %d of %d weight shapes, decode-sized ones for %d; %d keep one "
            "tile for every step (other tiles changed bits on this device: slower)", len(gemms.large_shapes),
            len(shapes), len(gemms.small_by_m), len(fixed),
        )  # fmt: skip
        return LayerOps(
            add_norm=partial(
                fk.add_rmsnorm, pdl=pdl, weight_fp32=owned.norm_math.weight_fp32, centred=owned.norm_math.centred
            ),
            linear=gemms.linear,
            gate_up_act=partial(gemms.gate_up_silu, act=ACT_CODES[owned.args.activation]),
            logits_epilogue=fk.logits_epilogue,
            pdl=pdl,
            qkv_rope_epilogue=True,
            qkv_rope_write=gemms.qkv_rope_write,
        )
    return LayerOps(
        add_norm=partial(fk.add_rmsnorm_ref, norm=NORMS[owned.family.norm]),
        linear=row_linear,
        gate_up_act=gate_up_then_act(row_linear, ACTIVATIONS[owned.args.activation]),
    )
