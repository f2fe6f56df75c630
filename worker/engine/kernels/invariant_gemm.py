"""Batch-invariant weight GEMMs for deterministic mode (EngineConfig.deterministic). Owns nothing but the tile plan.

Every weight product of a step, whatever its row count M, runs decode_gemm.py's Triton kernel, never cuBLAS
(cuBLAS picks kernels and split-K by M). The kernel reduces over K in one fixed order: K tiles in sequence, each
chained into the fp32 accumulator by the tensor cores' dot (`tl.dot(w, x, acc)`), no split-K. A row of x is then
computed from the same products added in the same order in every step, so its bits do not depend on M or on the
other rows.

Which tile shape to launch: on the H200 (2026-12-01, `benchmarks/invariant_gemm_sweep.py`) every configuration
swept (BLOCK_N 64-256, BLOCK_K 64 and 128, 4 and 8 warps, BLOCK_M 64-256, grouped or not) gave the same bits for
the same rows of every Llama-3-8B projection: the order of the K reduction is the whole story there. So the plan
here is decode_gemm's small tiles for decode-sized steps and large tiles (`LARGE_TILE`) for steps of at least
`LARGE_M` rows, which cuBLAS-sized prefill and 1,024-sequence decode steps need (one configuration for every M
cost W2 0.46x of the default mode). That the two give the same bits is a property of the compiler and the chip,
not a law, so it is checked, not assumed: `InvariantGemms.for_weights` runs every weight shape of the model
under each tile it could take once at build time, and keeps the small plan at BLOCK_M rows wherever bits differ
(Triton's CPU interpreter, whose dots round per K tile, finds that for the gated product's large tiles, whose K
tiles differ from its small plan's). Decode steps also take decode_gemm's rows per program for their M (16 at
M = 16) where that changes no bit.

The fused epilogues (SiLU·mul in the gate/up GEMM, rotary and the KV write in the QKV GEMM) are decode_gemm's,
which round as the unfused pair does (tests/worker/engine/test_fused_kernels.py checks it bit for bit), so they
are row-local too; the large plan runs the QKV GEMM then fused.qkv_rope_write.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from . import decode_gemm as dg
from . import fused as fk
from .common import OutOfResources

# Rows of x per program in the small (decode) plan, for every M, where tiles may not follow the step.
BLOCK_M = 64
# The large plan (the sweep's fastest at M = 1,024 and 8,192: 1.10x and 1.14x cuBLAS for a Llama-3-8B step, vs
# 2.54x for the small plan): 128 weight rows x 128 rows of x per program, K tiles of 64 (the small plan's), 8 warps,
# 3 stages, programs launched in groups of 8 weight tiles for L2 reuse.
LARGE_TILE: dg.Config = (128, 64, 8, 3)
LARGE_BLOCK_M = 128
LARGE_GROUP_N = 8
# Steps of at least this many rows take the large plan (a full LARGE_BLOCK_M block; the sweep's M = 32 favours the
# small plan, M = 1,024 the large one).
LARGE_M = 128
# Rows of the build-time check: two large blocks, the second one short.
_PROBE_ROWS = LARGE_BLOCK_M + 40


def gemm_config(n: int, k: int, dtype: torch.dtype) -> dg.Config | None:
    """decode_gemm's configuration for a [*, k] x [n, k]^T product at any depth (its MAX_K only routes deep
    products to cuBLAS for speed), or None when the shape does not tile."""
    # max_k=None: Llama-3-8B's down projection (K = 14,336) is deeper than decode_gemm's MAX_K; the H200 run of
    # W2 --deterministic found deterministic mode refusing it (2026-12-01).
    block_n, block_k, warps, stages = dg.WIDE_CONFIG if n > 8192 else dg.NARROW_CONFIG
    # A weight whose rows do not fill the configured tiles takes narrower ones: a tensor-parallel rank's vocabulary
    # shard (160 rows of the test model's 320; Phi-3's 32,064 / 2 and Gemma 3's 262,208 / 2 are not multiples of
    # 64 either). The tile's width never enters a row's K order, and one width serves every M of that weight.
    for width in (block_n, 32, 16):
        config = dg._fitted((width, block_k, warps, stages), n, k, dtype, max_k=None)
        if config is not None:
            return config
    return None


def gated_config(inter: int, k: int, dtype: torch.dtype) -> dg.Config | None:
    return dg._fitted(dg.GATED_CONFIG, inter, k, dtype, max_k=None)


def untiled(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of `weights` ([N, K] each) whose shape has no configuration: deterministic mode refuses them."""
    return [name for name, w in weights.items() if gemm_config(w.shape[0], w.shape[1], w.dtype) is None]


def _same_bits(product, want: torch.Tensor, **tiles) -> bool:
    """Whether `product` under `tiles` gives `want` bit for bit; a tile this GPU cannot launch (Triton's
    OutOfResources: shared memory, registers) gives False, so the plan keeps the tiles that ran."""
    try:
        return torch.equal(product(**tiles), want)
    except OutOfResources:
        return False


@dataclass(frozen=True)
class InvariantGemms:
    """The decoder's weight products in deterministic mode, with tiles that follow the step only where
    `for_weights` found them giving the same bits: a weight whose (N, K, gated) is in `large_shapes` takes the
    large tiles from `large_m` rows; one in `small_by_m` takes decode_gemm's rows per program for M (16-64) in the
    small plan; every other product takes the small plan at BLOCK_M rows."""

    pdl: bool = False
    large_shapes: frozenset[tuple[int, int, bool]] = frozenset()
    small_by_m: frozenset[tuple[int, int, bool]] = frozenset()
    large_m: int = LARGE_M

    @classmethod
    def for_weights(cls, weights: dict[str, torch.Tensor], gated: set[str], pdl: bool = False) -> InvariantGemms:
        """The plan for a model whose [N, K] weights are `weights` (`gated`: the names of fused [gate; up] ones):
        each distinct shape's product is computed once in the small plan at BLOCK_M rows per program, and compared
        bit for bit with the small plan at 16 and 32 rows and with the large plan."""
        large_shapes: set[tuple[int, int, bool]] = set()
        small_by_m: set[tuple[int, int, bool]] = set()
        probed: set[tuple[int, int, bool]] = set()
        gen = torch.Generator().manual_seed(0)
        for name, w in weights.items():
            is_gated = name in gated
            key = (w.shape[0], w.shape[1], is_gated)
            rows = w.shape[0] // 2 if is_gated else w.shape[0]
            small = (gated_config if is_gated else gemm_config)(rows, w.shape[1], w.dtype)
            if key in probed or small is None:
                continue
            probed.add(key)
            x = torch.randn(_PROBE_ROWS, w.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
            product = partial(dg.decode_gate_up_silu if is_gated else dg.decode_linear, x, w, pdl=pdl)
            want = product(config=small, block_m=BLOCK_M)
            if all(_same_bits(product, want, config=small, block_m=block_m) for block_m in (16, 32)):
                small_by_m.add(key)
            large = dg._fitted(LARGE_TILE, rows, w.shape[1], w.dtype, max_k=None)
            if large is not None:
                if _same_bits(product, want, config=large, block_m=LARGE_BLOCK_M, group_n=LARGE_GROUP_N):
                    large_shapes.add(key)
        return cls(pdl=pdl, large_shapes=frozenset(large_shapes), small_by_m=frozenset(small_by_m))

    def _large(self, weight: torch.Tensor, m: int, gated: bool) -> dg.Config | None:
        """The large tiles where an [m, K] x weight [N, K]^T product takes them, else None."""
        n, k = weight.shape
        if m < self.large_m or (n, k, gated) not in self.large_shapes:
            return None
        return dg._fitted(LARGE_TILE, n // 2 if gated else n, k, weight.dtype, max_k=None)

    def _plan(self, weight: torch.Tensor, m: int, gated: bool) -> tuple[dg.Config | None, int, int]:
        """(configuration, BLOCK_M, GROUP_N) for an [m, K] x weight [N, K]^T product (gated: [gate; up])."""
        large = self._large(weight, m, gated)
        if large is not None:
            return large, LARGE_BLOCK_M, LARGE_GROUP_N
        n, k = weight.shape
        config = (gated_config if gated else gemm_config)(n // 2 if gated else n, k, weight.dtype)
        return config, dg.block_m_for(m) if (n, k, gated) in self.small_by_m else BLOCK_M, 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """x [M, K] @ weight [N, K]^T (+ bias), batch-invariant."""
        config, block_m, group_n = self._plan(weight, x.shape[0], gated=False)
        assert config is not None, f"weight {tuple(weight.shape)} does not tile (checked when the decoder is built)"
        return dg.decode_linear(
            x.contiguous(), weight, bias, pdl=self.pdl, config=config, block_m=block_m, group_n=group_n
        )

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, act: int = 0):
        """act(x @ gate^T) * (x @ up^T) (SiLU, or fused.ACT_GELU_TANH) for the fused [gate; up] weight,
        batch-invariant (fused when the intermediate size tiles, else the GEMM then the row-local act_mul kernel)."""
        x = x.contiguous()
        config, block_m, group_n = self._plan(weight, x.shape[0], gated=True)
        if config is None:
            return fk.act_mul(self.linear(x, weight, bias), pdl=self.pdl, act=act)
        return dg.decode_gate_up_silu(
            x, weight, bias, pdl=self.pdl, config=config, block_m=block_m, act=act, group_n=group_n
        )

    def qkv_rope_write(self, x, weight, bias, positions, cos_table, sin_table, num_heads, num_kv_heads, k_cache,
                       v_cache, slot_mapping, *, pdl=None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # fmt: skip
        """decode_gemm.decode_qkv_rope_write at any depth, batch-invariant: the fused kernel in the small plan (the
        two launches when the heads do not hold whole groups of rotary pairs), the large GEMM then
        fused.qkv_rope_write in the large one. `pdl` is the plan's (the argument keeps LayerOps' signature)."""
        m, k = x.shape
        x = x.contiguous()
        head_dim = cos_table.shape[-1]
        n = weight.shape[0]
        if self._large(weight, m, gated=False) is not None:
            qkv = self.linear(x, weight, bias)
            return fk.qkv_rope_write(
                qkv, positions, cos_table, sin_table, None, None, 0.0, num_heads, num_kv_heads,
                k_cache, v_cache, slot_mapping, pdl=self.pdl, kv_scale=kv_scale,
            )  # fmt: skip
        config, block_m, _ = self._plan(weight, m, gated=False)
        rope = None
        if head_dim % (2 * dg.ROPE_PAIRS) == 0 and dg.ROPE_CONFIG[0] == 2 * dg.ROPE_PAIRS:
            rope = dg._fitted(dg.ROPE_CONFIG, n, k, x.dtype)
        return dg.decode_qkv_rope_write(
            x, weight, bias, positions, cos_table, sin_table, num_heads, num_kv_heads,
            k_cache, v_cache, slot_mapping, pdl=self.pdl, config=rope, kv_scale=kv_scale,
            linear_config=config, block_m=block_m,
        )  # fmt: skip
