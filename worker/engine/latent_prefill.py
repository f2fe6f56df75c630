"""Multi-head latent attention's prefill over expanded K/V (DeepSeek-V2/V3, Kimi K2, Moonlight), beside the absorbed
attention of latent_attention.py. Owns the choice between the two for a step's prefill rows and the expanded path.

Absorbed, each (query row, key, head) costs kv_lora + rope + kv_lora multiply-adds (the score over the latent and the
rotary key, then the probabilities times the latent): 1,088 at DeepSeek's 512 + 64. Expanded, the context's latent
rows are first multiplied by kv_b_proj once, kv_lora x (nope + v) per (key, head) (131,072 at 512 x 256), and then
attention costs (nope + rope) + v per (query row, key, head) (320): per-head attention as transformers computes it,
through the backend's ordinary paged prefill kernel (head width 192, where the absorbed one reads 576-wide rows as one
head padded to 1,024). So expanding pays off once a sequence's prefill rows outnumber kv_lora x (nope + v) /
(1,088 - 320), about 171 rows at DeepSeek's widths, and more so on a GPU, where the expanded heads take the prefill
kernel's large tiles. vLLM and SGLang prefill the same way; decode rows stay absorbed (their one row never pays for
an expansion).

`CBQ_MLA_PREFILL` picks: "auto" (the default: expanded where the step's multiply-adds say so, above), "absorbed" or
"expanded" (the tests and the before/after benchmark). Either way a step's expanded K and V are bounded
(`EXPANDED_ELEMENTS`): a step past it stays absorbed.

The expanded path gathers the cache blocks of the prefill sequences' contexts (whole blocks, in order; the plan is
made once a step from the host's `prefill_lens` and reused by every layer: `AttentionMetadata.step_cache`), reads
them as the cache stores them (an FP8 cache's rows times its scale), multiplies the latent by kv_b_proj's rows into
every head's no-rotary key and value, joins the shared rotary key to each head's key, pads the value to the key's
width (the cache layout the kernels take: K and V alike) and attends through the backend over these blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .attention import from_cache
from .attention_backend import AttentionMetadata

MLA_PREFILL_ENV = "CBQ_MLA_PREFILL"
MLA_PREFILL_CHOICES = ("auto", "absorbed", "expanded")
# The most elements of a step's expanded K and V together (bf16: 512 MiB; with the expansion's own output, ~1 GiB at
# most in flight, inside kv_cache.ACTIVATION_RESERVE_BYTES); beyond it the step's prefill stays absorbed. DeepSeek-V2-Lite
# (16 heads) expands up to ~43k context tokens a step.
EXPANDED_ELEMENTS = 1 << 28
_PLAN_KEY = "latent_prefill_plan"
_CHOICE_KEY = "latent_prefill_expands"


@dataclass(frozen=True)
class LatentWidths:
    """One layer's latent attention widths: heads (this rank's), the no-rotary and rotary query/key parts, the value,
    the latent."""

    heads: int
    nope: int
    rope: int
    v: int
    kv_lora: int

    def absorbed_macs(self) -> int:
        """Multiply-adds per (query row, key, head), absorbed."""
        return 2 * self.kv_lora + self.rope

    def expanded_macs(self) -> int:
        """Multiply-adds per (query row, key, head), expanded."""
        return self.nope + self.rope + self.v

    def expansion_macs(self) -> int:
        """Multiply-adds per (key, head) of the expansion."""
        return self.kv_lora * (self.nope + self.v)


def prefill_choice() -> str:
    choice = os.environ.get(MLA_PREFILL_ENV, "auto")
    if choice not in MLA_PREFILL_CHOICES:
        raise ValueError(f"{MLA_PREFILL_ENV}={choice!r}: expected one of {', '.join(MLA_PREFILL_CHOICES)}")
    return choice


def expands(meta: AttentionMetadata, widths: LatentWidths, block_size: int) -> bool:
    """Whether this step's prefill rows (`meta`: the sequences after the leading decodes) attend over expanded K/V.
    Decided by the step's first layer and kept for the others (every layer of a model has the same widths)."""
    if not meta.prefill_lens:  # a decode-only step, or metadata built without the host's lengths
        return False
    decided = meta.step_cache.get(_CHOICE_KEY)
    if decided is None:
        decided = meta.step_cache[_CHOICE_KEY] = _expands(meta.prefill_lens, widths, block_size)
    return decided


def _expands(prefill_lens: tuple[tuple[int, int], ...], widths: LatentWidths, block_size: int) -> bool:
    choice = prefill_choice()
    if choice == "absorbed":
        return False
    gathered = sum(-(-context // block_size) for _, context in prefill_lens) * block_size
    if gathered * widths.heads * 2 * (widths.nope + widths.rope) > EXPANDED_ELEMENTS:
        return False
    if choice == "expanded":
        return True
    pairs = sum(q_len * context for q_len, context in prefill_lens)
    keys = sum(context for _, context in prefill_lens)
    saved = pairs * (widths.absorbed_macs() - widths.expanded_macs())
    return saved >= keys * widths.expansion_macs()


@dataclass(frozen=True)
class _Plan:
    """The prefill sequences' context blocks, gathered in order, and each sequence's block table into them."""

    block_ids: torch.Tensor  # [NB] latent cache blocks
    block_tables: torch.Tensor  # [P, max blocks] rows of the gathered blocks


def _plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    plan = meta.step_cache.get(_PLAN_KEY)
    if plan is None:
        counts = [-(-context // block_size) for _, context in meta.prefill_lens]
        tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
        rows: list[int] = []
        cols: list[int] = []
        start = 0
        for i, count in enumerate(counts):
            tables[i, :count] = torch.arange(start, start + count, dtype=torch.int32)
            rows += [i] * count
            cols += range(count)
            start += count
        device = meta.block_tables.device
        block_ids = meta.block_tables[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].long()
        plan = meta.step_cache[_PLAN_KEY] = _Plan(block_ids, tables.to(device))
    return plan


def expanded_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    widths: LatentWidths,
    scale: float,
    cache_scale: float,
) -> torch.Tensor:
    """Attention of the prefill rows over expanded K/V. `meta`: a step of prefill sequences alone (a mixed step's part
    after its decodes: latent_attention's `_prefill_part`), whose latent rows the cache already holds. q_nope
    [P, H, nope], q_rope [P, H, rope] (rotated), cache [blocks, block_size, 1, kv_lora + rope], kv_b: kv_b_proj's
    weight per head [H, nope + v, kv_lora] -> [P, H, v]."""
    assert meta.num_decode_seqs == 0, "the step's decodes are attended apart"
    block_size = cache.shape[1]
    plan = _plan(meta, block_size)
    rows = from_cache(cache[plan.block_ids, :, 0], q_nope.dtype, cache_scale)  # [NB, bs, kv_lora + rope]
    latent, k_rope = torch.split(rows, [widths.kv_lora, widths.rope], dim=-1)
    heads, nope = widths.heads, widths.nope
    kv = F.linear(latent, kv_b.reshape(heads * (nope + widths.v), widths.kv_lora))
    kv = kv.view(*latent.shape[:2], heads, nope + widths.v)  # [NB, bs, H, nope + v]: kv_b_proj(latent), per head
    key = torch.cat((kv[..., :nope], k_rope[:, :, None].expand(-1, -1, heads, -1)), dim=-1)
    value = F.pad(kv[..., nope:], (0, nope + widths.rope - widths.v))  # K's width: one cache layout for both
    sub = replace(
        meta,
        kv_caches=[],
        block_tables=plan.block_tables,
        sliding_windows=(),
        kv_scales=(),
        prefill_lens=(),
        step_cache={},
    )
    query = torch.cat((q_nope, q_rope), dim=-1)
    out = meta.backend.attend(query, key, value, sub, scale, 0)
    return out[..., : widths.v]
