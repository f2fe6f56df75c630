"""The owned decoder: cbq's own forward over the paged KV cache, for every family whose declaration
(families/spec.py) it implements. `unimplemented` checks each declared property against what this file
computes, so a family that declares anything else keeps transformers' forward ("auto") or is refused ("owned").

Every family the gate passes takes the Triton kernels below on CUDA, the declaration read as kernel flags (no
family is named): the norm's arithmetic (`NORM_MATH`: Llama's rounding, or the weight multiplied in fp32, OLMo 2's
and Gemma's, whose (1 + w) is folded into an fp32 weight at load, exactly: `fused.fold_one_plus`), the activation
(`ACT_CODES`: SiLU or GELU-tanh, in the act·mul kernel and the gate/up GEMM's epilogue), a block's post-norm and
residual multiplier (Gemma's sandwich norms, OLMo 2's post-norms, Granite) and the embedding scale as epilogues of
the next add+norm launch, attention soft-capping in the attention kernels (SOFTCAP), and the final logits' divisor,
scale and soft-cap in one launch. The q/k scale (Gemma's query_pre_attn_scalar, Granite's attention multiplier) is
the attention kernels' scale. What no kernel computes yet runs as torch ops inside the same forward, for that
stage only: the q/k norm + rotary + KV-write stage of layers with q/k norms over the whole projection (OLMo 2),
partial, interleaved (GLM-4, Phi-4-mini) or no rotary (SmolLM3's NoPE layers) (`rope_kernel`).

Owns the fused layer weights (views into the HF model's parameters, see `fused_weights.py`) and the
rotary cos/sin tables. A linear the loader kept in FP8 (sm89+ CUDA; quant/) is multiplied by its method's FP8
GEMM (`weight_linear`), its q/k/v or gate/up scales fused with its rows; on the small-step path (decode_gemm
"auto" or "triton", see `build_decoder`) by quant/small_step.py's PDL kernel, x quantized inside it. A linear kept
as packed INT4 (quant/int4/) is multiplied by the W4A16 GEMM (kernels/w4a16.py; on small steps in the PDL chain,
act·mul in the gate/up launch's epilogue, rotary and the KV write in the QKV launch's). Built from
the transformers model that `models.load_model` returns, so every checkpoint that loads runs here; the HF model
stays usable (the tests' reference, `model.generate`).

Per layer (CUDA, 8 launches + attention; 6 on the small-step path, bf16 or FP8 weights alike, where SiLU·mul is
in the gate/up GEMM's epilogue and rotary with the KV write in the QKV GEMM's (7 with Qwen3's and Gemma 3's q/k
norms, which need a whole head); Gemma's sandwich norms add no launch):
    add_rmsnorm -> QKV GEMM -> qkv_rope_write (q/k norm, rotary, KV write) -> attention -> O GEMM
    -> add_rmsnorm -> gate/up GEMM -> silu_mul -> down GEMM
against transformers' ~16 (three q/k/v GEMMs, two gate/up GEMMs, separate adds, SiLU, mul, rotary,
norms and the KV write). On CPU the same structure runs through the torch references in
`kernels/fused.py`, which compute transformers' functions exactly; fp32 greedy output equals
`model.generate` token for token (tests/worker/engine/test_engine_exact.py).

Mixture-of-experts families (the declaration's `Family.moe`) run `moe.moe_forward` in their sparse layers
instead of the gate/up and down GEMMs: the PyTorch reference on the CPU, the Triton grouped GEMMs in one
workspace (sized here from the largest step) on CUDA; the experts are the model's own stacked tensors (in FP8 with
their scales where the loader kept them so, moe/fp8_experts.py: then the FP8 grouped GEMMs, moe/triton_fp8.py).

Rotary uses the model's own `inv_freq` and `attention_scaling` (default, llama3, yarn, linear, ...
rope types stay exact; a table narrower than the head is partial rotary). "dynamic" rope, whose frequencies change
with the sequence length at run time, is refused at load. longrope (Phi-3/Phi-4 128k) keeps two tables in one
(`longrope_tables`): each token's `positions` entry is its row there, which the batch builder offsets into the long
part for a sequence longer than the original context (every kernel reads a position only as a table row; the KV
slots come from the slot mapping). So each sequence rotates as it would alone in `generate`, whatever the batch.

Steps of at most `decode_gemm.MAX_TOKENS` tokens (small decode batches, W1) take the small-step path
on sm90+: Triton weight GEMMs (kernels/decode_gemm.py), SiLU·mul in the gate/up GEMM's epilogue, rotary and the KV
write in the QKV GEMM's, and every launch chained by programmatic dependent launch (kernels/pdl.py), so each kernel is
already on the SMs when the one before it finishes. Larger steps keep cuBLAS.

A vision-language model (Qwen2.5-VL, Qwen3-VL, Mistral 3, Gemma 3: `Family.vision`) runs its language model here,
read through transformers' whole model (models/vision.py `family_root`). A step with image rows passes `ImageInputs`
(image_inputs.py): its input embeddings replace the token embeddings (and the embedding scale, which they hold in
their token rows already), its M-RoPE positions become per-token cos/sin tables read at rows 0..T-1 (so every rotary
kernel runs unchanged), and Qwen3-VL's DeepStack levels join the first layers' outputs. Steps without image rows (decodes, their CUDA graphs) run on ids and the 1-D positions the batch
builder wrote (M-RoPE's three rows are alike outside images: a generated token's index + the request's delta).

The forward reads no device value on the host and branches only on shapes and host flags, so it is
CUDA-graph capturable. Logits are computed only for the rows asked for.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from . import deterministic as invariant
from .attention_backend import AttentionMetadata
from .config import DECODE_GEMMS, DECODERS
from .families.spec import RUNTIME_ROPE_TYPES, DecoderArgs, Family, QKNormSpan, longrope_original_len
from .fused_weights import LayerWeights, fold_norms, layer_weights, submodule
from .image_inputs import ImageInputs, mrope_axes, mrope_rope
from .kernels import decode_gemm
from .kernels import fused as fk
from .kv_cache import head_dim_of
from .latent_attention import install_latent_attention
from .latent_layer import LatentAttention, LatentRope, latent_layer_spec
from .latent_prefill import prefill_choice
from .layer_ops import ACTIVATIONS, NORM_MATH, NORMS, QK_NORM_SPANS, layer_ops, rows_for
from .layers.tensor_parallel import Shard, TensorParallel, WholeModel
from .models import ModelLoadError, family_for
from .models.moe_from_model import moe_layer_weights
from .models.vision import family_root
from .moe import MoeLayerWeights, MoeWorkspace, moe_forward, moe_layer_ids, spec_from_config


def _latent_attention_model(model, choice: str, deterministic: bool, tp: TensorParallel | None) -> None:
    """A multi-head latent attention model on transformers' layers (returns None: `build_decoder` says when). Under
    any decoder but "hf" (transformers' attention over an expanded per-head cache) its attention modules run cbq's
    latent attention over the latent cache (latent_attention.py, kv_cache.uses_latent_cache). A tensor-parallel shard (`tp`)
    runs the same forward: its loading put the collectives in its modules (models/shard_model.py), so none is named
    here, and it never runs "hf" (shard_model refuses it)."""
    if deterministic:
        raise ValueError("multi-head latent attention runs no --deterministic yet")
    assert tp is None or choice != "hf", "a tensor-parallel shard runs the owned decoder or the latent attention"
    if choice != "hf":
        install_latent_attention(model)
    return None


def unsupported_reason(model) -> str | None:
    """Why the owned decoder cannot run `model` (None: it can). A vision-language model (models/vision.py) is
    asked about its language model, whose paths and config its family names from the whole model."""
    try:
        root, family, args = _family(model)
    except ModelLoadError as exc:
        return str(exc)
    rope_types = getattr(submodule(root, family.rotary_path), "rope_type", "default")
    for rope_type in rope_types.values() if isinstance(rope_types, dict) else [rope_types]:  # per layer type
        runs_it = rope_type == "longrope" and family.longrope and not isinstance(rope_types, dict)
        if rope_type in RUNTIME_ROPE_TYPES and not runs_it:  # a model changed after loading (the loader refuses it)
            return f"rope type {rope_type!r} changes its frequencies at run time"
    return unimplemented(family, args)


def _family(model) -> tuple[Any, Family, DecoderArgs]:
    """The module the family's paths start from, the family and the numbers it reads: for a vision-language model,
    transformers' whole model and the family that takes its images (families/registry.py `IMAGE_MODULES`)."""
    root = family_root(model)
    family, args = family_for(root.config, images=root is not model)
    return root, family, args


def unimplemented(family: Family, args: DecoderArgs) -> str | None:
    """The first property `family` declares (with `args` read from a config) that this decoder does not compute."""
    layer = family.layer
    if family.norm not in NORMS:
        return f"{family.name}: norm {family.norm.value}"
    if args.activation not in ACTIVATIONS:
        return f"{family.name}: activation {args.activation.value}"
    if layer.q_norm is not None and layer.qk_norm_span not in QK_NORM_SPANS:
        return f"{family.name}: q/k norm over the {layer.qk_norm_span.value} projection"
    if layer.parallel_blocks and (layer.attn_out_norm is not None or layer.mlp_out_norm is not None):
        return f"{family.name}: post-norms on parallel attention and MLP blocks"
    if layer.parallel_blocks and args.residual_scale is not None:
        return f"{family.name}: a residual multiplier on parallel attention and MLP blocks"
    vision = family.vision  # every image format's rows, the mask of bidirectional ones included (attention.py)
    if vision is not None and vision.deepstack and (layer.mlp_out_norm is not None or args.residual_scale is not None):
        return f"{family.name}: DeepStack after a post-norm or residual multiplier"
    return None


def rope_kernel(family: Family, rope: tuple[torch.Tensor, torch.Tensor] | None, head_dim: int) -> bool:
    """Whether the Triton q/k-norm + rotary + KV-write kernels compute a layer with rotary tables `rope` (None: a
    NoPE layer): full Llama-style rotary, q/k norms (if any) per head. Else that stage runs as torch ops."""
    layer = family.layer
    head_qk_norms = layer.q_norm is None or layer.qk_norm_span == QKNormSpan.HEAD
    full_rotary = rope is not None and rope[0].shape[-1] == head_dim and not family.rotary_interleaved
    return head_qk_norms and full_rotary


class OwnedDecoder:
    def __init__(
        self, model, max_model_len: int, use_triton: bool, small_step_gemm: bool = False, max_num_tokens: int = 0,
        deterministic: bool = False, tp: TensorParallel | None = None,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the owned decoder does not support this model: {reason}")
        config = model.config  # a vision-language model's: its language model's
        root, self.family, self.args = _family(model)  # root: where the family's paths start
        # A tensor-parallel shard (models/shard_model.py): `model` holds this rank's heads and columns, and `tp`
        # sums or gathers between them. None: the whole model is here (TP=1). `shard` is either, as the forward
        # reads it (layers/tensor_parallel.py).
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.eps = getattr(config, self.family.norm_eps_field)
        self.norm_math = NORM_MATH[self.family.norm]
        self.parallel_blocks = self.family.layer.parallel_blocks
        fold = self.norm_math.fold
        self.embed_weight = submodule(root, self.family.embed_path).weight
        self.shard: Shard = tp if tp is not None else WholeModel(self.embed_weight)
        self.final_norm = submodule(root, self.family.final_norm_path).weight
        self.final_norm = fold(self.final_norm) if fold is not None else self.final_norm
        # the embedding itself when tied; None for a base model without an LM head (an embedding model: worker/embedding
        # runs `final_hidden` only)
        output_embeddings = root.get_output_embeddings()
        self.lm_head = output_embeddings.weight if output_embeddings is not None else None
        layers = submodule(root, self.family.layers_path)
        sparse = set(moe_layer_ids(config)) if self.family.moe is not None else set()
        # multi-head latent attention: `qkv` is its input projection (latent_layer.py)
        layer_spec = self.family.layer
        if self.family.mla is not None:
            layer_spec = latent_layer_spec(self.family, config, layers, self.embed_weight.dtype)
        self.layers: list[LayerWeights] = [
            fold_norms(layer_weights(layer, layer_spec, dense_mlp=i not in sparse), fold)
            for i, layer in enumerate(layers)
        ]
        self._init_moe(model, layers, sparse, max_num_tokens)
        sinks = self.family.attention_sinks
        self.layer_sinks = [None if sinks is None else submodule(layer, sinks) for layer in layers]
        num_positions = max(max_model_len, config.max_position_embeddings)
        rotary_emb = submodule(root, self.family.rotary_path)
        longrope_len = longrope_original_len(config)
        if longrope_len is not None:  # one table, read at rows the batch builder offsets per sequence
            layer_types = [None] * len(self.layers)
            tables = {None: longrope_tables(rotary_emb, num_positions, self.embed_weight, longrope_len)}
        elif self.family.rope_per_layer_type:
            layer_types = config.layer_types
            tables = {t: rotary_tables(rotary_emb, num_positions, self.embed_weight, t) for t in set(layer_types)}
        else:
            layer_types = [None] * len(self.layers)
            tables = {None: rotary_tables(rotary_emb, num_positions, self.embed_weight)}
        # Each layer's (cos, sin) tables; None for a layer without rotary (NoPE).
        self.layer_rope: list[tuple[torch.Tensor, torch.Tensor] | None] = [
            None if i in self.args.nope_layers else tables[t] for i, t in enumerate(layer_types)
        ]
        self.head_dim = head_dim_of(config)
        # Multi-head latent attention: each layer's attention object (latent_layer.py), which the layer loop calls in
        # place of the QKV/rotary/attention stage; None: the per-head attention below.
        self.latent: list[LatentAttention] | None = None
        if self.family.mla is not None:
            rope = LatentRope(rotary_emb, num_positions, self.embed_weight)
            mla, dtype = self.family.mla, self.embed_weight.dtype
            self.latent = [LatentAttention(layer, mla, w, rope, dtype) for layer, w in zip(layers, self.layers, strict=True)]
        # M-RoPE (a vision-language family's `VisionSpec.mrope`): the position row each rotary dimension reads, for
        # steps with image rows (image_inputs.py); None: 1-D rotary everywhere
        self.mrope_axes: torch.Tensor | None = None
        mrope = self.family.vision.mrope if self.family.vision is not None else None
        if mrope is not None:  # the families with M-RoPE keep one rotary table (tables[None])
            axes = mrope_axes(mrope, rotary_emb.mrope_section, tables[None][0].shape[-1])
            self.mrope_axes = axes.to(self.embed_weight.device)
        # Per layer: whether the Triton q/k-norm + rotary + KV-write kernels compute it (else torch ops, that stage).
        self.rope_kernel = [rope_kernel(self.family, rope, self.head_dim) for rope in self.layer_rope]
        # A 0-dim CPU tensor in the model dtype multiplies as Gemma's rounded scale does (as transformers makes
        # it; the kernels read its value on the host, no sync); a float as Granite's.
        scale = self.args.embed_scale
        in_dtype = scale is not None and self.args.embed_scale_in_dtype
        self.embed_scale = torch.tensor(scale, dtype=self.embed_weight.dtype) if in_dtype else scale
        self.norm = self.norm_math.ref
        # q/k norms over the whole projection (OLMo 2) of a shard: the statistic summed over the ranks' heads
        self.qk_norm = self.norm
        if tp is not None and self.family.layer.qk_norm_span == QKNormSpan.FULL:
            self.qk_norm = partial(self.norm, mean_square=tp.mean_square)
        self.use_triton = use_triton and fk.HAVE_TRITON
        norm, act = self.family.norm, self.args.activation
        self.ops = layer_ops(self.use_triton, False, norm=norm, activation=act)
        # Steps of at most decode_gemm.MAX_TOKENS tokens (None: they take `ops` too). Its GEMMs take each weight as
        # it is, through its own method (layer_ops.py); `build_decoder` decides whether a quantized model takes this path.
        self.is_quantized = any(w.is_quantized for w in self.layers)
        # Per layer, how the kernels before the QKV, gate/up and down GEMMs write their rows for them (the
        # attention-in norm, the MLP-in norm, act·mul): as that linear's method reads them (`layer_ops.rows_for`),
        # or None for plain rows (a sparse MLP's router too). Parallel blocks: one norm feeds QKV and gate/up, so its
        # rows stay plain and each linear takes them as they are.
        self.input_rows = [
            (
                None if self.parallel_blocks else rows_for(w.qkv_weight),
                None if self.parallel_blocks or w.gate_up_weight is None else rows_for(w.gate_up_weight),
                None if w.gate_up_weight is None else rows_for(w.down_weight),
            )
            for w in self.layers
        ]
        small_step = small_step_gemm and self.use_triton
        self.small_step_ops = layer_ops(True, small_step=True, norm=norm, activation=act) if small_step else None
        if deterministic:  # one set of batch-invariant ops for every step size (deterministic.py)
            self.ops = invariant.layer_ops(self, pdl=small_step_gemm)
            self.small_step_ops = None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [R, V] for the rows `logits_indices` (None: all T). `positions`: each
        token's row of the rotary tables, its position (longrope: offset per sequence, see `longrope_tables`).
        `images`: a step with image rows (image_inputs.py): its input embeddings replace the ids', its M-RoPE
        positions `positions`, and its DeepStack features join the first layers' outputs."""
        assert self.lm_head is not None, "a model without an LM head computes final_hidden only"
        normed, ops = self.final_hidden(input_ids, positions, attn, logits_indices, images)
        args = self.args
        logits = self.shard.full_logits(ops.linear(normed, self.lm_head, None))
        return ops.logits_epilogue(logits, args.logits_divisor, args.logits_scale, args.final_softcap)

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        rows: torch.Tensor | None = None,
        images: ImageInputs | None = None,
    ):
        """The final norm's output [R, hidden] for the rows `rows` (None: all T), as a base model's last hidden
        state, and the ops that computed it. `__call__` puts the LM head on it; an embedding model pools it."""
        ops = self.ops
        if self.small_step_ops is not None and input_ids.shape[0] <= decode_gemm.MAX_TOKENS:
            ops = self.small_step_ops
        args, eps = self.args, self.eps
        hidden = self.shard.embed(input_ids) if images is None else images.embeds
        layer_rope = self.layer_rope
        if images is not None and self.mrope_axes is not None:  # per-token tables, read at rows 0..T-1
            positions, layer_rope = mrope_rope(images.positions, layer_rope, self.mrope_axes, positions.dtype)
        num_deepstack = len(images.deepstack) if images is not None else 0
        residual = None
        # What the next add+norm applies to `hidden` before adding it to the residual: the post-norm of the block
        # that made it and the residual multiplier (the embedding scale, before the first layer).
        # An image step's embeddings come from the model's own embedding module, the scale in its token rows
        # (Gemma's) and none in its image rows, as transformers feeds them: no scale here then.
        post_norm, scale = None, self.embed_scale if images is None else None
        for layer_idx, w in enumerate(self.layers):
            k_cache, v_cache = attn.kv_caches[layer_idx]
            attn_rows, mlp_rows, down_rows = self.input_rows[layer_idx]
            add_norm = ops.add_norm_into(attn_rows)
            normed, residual = add_norm(hidden, residual, w.attn_in_norm, eps, x_weight=post_norm, x_scale=scale)
            if self.latent is not None:  # its own projections, rotary, cache write and attention
                out = self.latent[layer_idx](normed, positions, attn, layer_idx, ops)
            else:
                q = self._qkv_rope_write(
                    normed, positions, layer_rope[layer_idx], w, layer_idx, k_cache, v_cache, attn, ops,
                    attn.kv_scale(layer_idx),
                )  # fmt: skip
                out = attn.backend.attend(
                    q, k_cache, v_cache, attn, args.attention_scale, layer_idx, pdl=ops.pdl,
                    softcap=args.attn_softcap, sinks=self.layer_sinks[layer_idx],
                )  # fmt: skip
            hidden = self.shard.row_parallel_out(ops.linear(out.view(out.shape[0], -1), w.o_weight, w.o_bias))
            post_norm, scale = w.attn_out_norm, args.residual_scale
            if self.parallel_blocks:
                # Cohere: the MLP reads the attention's input, and the layer's output is (residual + attention) +
                # MLP, in that order: the attention joins the residual here, the MLP at the next add+norm (the gate
                # refuses post-norms and a residual multiplier on these blocks)
                residual = residual + hidden
            else:
                add_norm = ops.add_norm_into(mlp_rows)
                normed, residual = add_norm(hidden, residual, w.mlp_in_norm, eps, x_weight=post_norm, x_scale=scale)
            moe = self.moe_layers[layer_idx]
            if moe is not None:
                hidden = moe_forward(normed, moe, self.moe_spec, self.moe_workspace)
            else:  # act·mul writes its rows as down reads them
                activated = ops.gate_up_act_into(down_rows)(normed, w.gate_up_weight, w.gate_up_bias)
                hidden = ops.linear(activated, w.down_weight, w.down_bias)
            hidden = self.shard.row_parallel_out(hidden)  # down's, or the experts' (split by intermediate size)
            post_norm = w.mlp_out_norm
            if layer_idx < num_deepstack:  # the layer's output with its DeepStack level: the next residual stream
                assert images is not None
                hidden, residual = images.add_deepstack(layer_idx, hidden, residual), None
        if rows is not None:  # the final norm is per row: only the rows asked for need it
            assert residual is not None, "a model has at least one layer"
            hidden, residual = hidden[rows], residual[rows]
        normed, _ = ops.add_norm(hidden, residual, self.final_norm, eps, x_weight=post_norm, x_scale=scale)
        return normed, ops

    def _init_moe(self, model, layers, sparse: set[int], max_num_tokens: int) -> None:
        """The sparse layers' weights (views of the model's stacked experts), and on CUDA the grouped GEMMs'
        workspace, sized for the largest step (`max_num_tokens`) and shared by every sparse layer."""
        self.moe_layers: list[MoeLayerWeights | None] = [None] * len(layers)
        self.moe_workspace: MoeWorkspace | None = None
        if not sparse:
            return
        assert self.family.moe is not None
        self.moe_spec = spec_from_config(model.config)
        for i in sorted(sparse):
            self.moe_layers[i] = moe_layer_weights(layers[i], self.family.moe, self.moe_spec)
        if self.embed_weight.is_cuda:
            assert max_num_tokens > 0, "the owned decoder of an MoE model on CUDA needs the largest step's tokens"
            self.moe_workspace = MoeWorkspace.allocate(
                self.moe_spec, max_num_tokens, self.embed_weight.dtype, self.embed_weight.device
            )

    def _qkv_rope_write(
        self, normed, positions, rope, w: LayerWeights, layer_idx: int, k_cache, v_cache, attn: AttentionMetadata,
        ops, kv_scale,
    ):
        """The QKV projection, q/k norms, rotary (`rope`: the layer's cos/sin tables, read at `positions`) and the
        KV write (`kv_scale`: an FP8 cache's (k_scale, v_scale)); returns q [T, H, D]."""
        cos_table, sin_table = rope if rope is not None else (None, None)  # None: a NoPE layer
        kernel = self.use_triton and self.rope_kernel[layer_idx]
        # The rotary + KV-write epilogue: `ops.qkv_rope_write` takes the weight as it is (bf16/fp16 or FP8).
        if ops.qkv_rope_epilogue and w.q_norm is None and kernel:
            assert cos_table is not None and sin_table is not None, "rope_kernel: a rotating layer"
            return ops.qkv_rope_write(
                normed, w.qkv_weight, w.qkv_bias, positions, cos_table, sin_table,
                self.num_heads, self.num_kv_heads, k_cache, v_cache, attn.slot_mapping, pdl=ops.pdl, kv_scale=kv_scale,
            )  # fmt: skip
        qkv = ops.linear(normed, w.qkv_weight, w.qkv_bias)
        args = (qkv, positions, cos_table, sin_table, w.q_norm, w.k_norm, self.eps)
        if kernel:
            return fk.qkv_rope_write(
                *args, self.num_heads, self.num_kv_heads, k_cache, v_cache, attn.slot_mapping, pdl=ops.pdl,
                norm_fp32_weight=self.norm_math.weight_fp32, kv_scale=kv_scale,
            )  # fmt: skip

        def write_kv(k, v):
            attn.backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping, kv_scale)

        qk_norm_full = self.family.layer.qk_norm_span == QKNormSpan.FULL
        return fk.qkv_rope_write_ref(
            *args,
            self.num_heads,
            self.num_kv_heads,
            write_kv,
            norm=self.qk_norm,
            qk_norm_full=qk_norm_full,
            interleaved=self.family.rotary_interleaved,
        )


def rotary_tables(
    rotary_emb, num_positions: int, like: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, D] in the model dtype, computed as transformers' rotary forward does
    (fp32 position x inv_freq, cat, cos/sin, times attention_scaling, cast), so lookups are bit-equal.
    `layer_type`: the table of that layer type, for rotary modules that keep one per type (Gemma 3)."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    inv_freq = getattr(rotary_emb, f"{prefix}inv_freq")
    return cos_sin_table(inv_freq, getattr(rotary_emb, f"{prefix}attention_scaling"), num_positions, like)


def longrope_tables(
    rotary_emb, num_positions: int, like: torch.Tensor, original_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """longrope's two tables in one, cos/sin [original_len + num_positions, D]: rows [0, original_len) rotate with the
    short factors (a sequence at most `original_len` long reads its positions there), rows original_len + p with the
    long ones (a longer sequence reads position p there: batch.py offsets its rows). Each as transformers' forward
    makes it: the short inv_freq from the rotary's init (`original_inv_freq`: `inv_freq` holds whichever table the
    last forward picked), the long one from the longrope init at original_len + 1 positions on the model's device
    (as `dynamic_rope_update` computes it), and one attention_scaling for both (longrope's depends on the lengths
    only, never on the sequence)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short_inv_freq = getattr(rotary_emb, "original_inv_freq", rotary_emb.inv_freq)
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary_emb.config, like.device, seq_len=original_len + 1)
    scaling = rotary_emb.attention_scaling
    short_cos, short_sin = cos_sin_table(short_inv_freq, scaling, original_len, like)
    long_cos, long_sin = cos_sin_table(long_inv_freq, scaling, num_positions, like)
    return torch.cat((short_cos, long_cos)), torch.cat((short_sin, long_sin))


def cos_sin_table(
    inv_freq: torch.Tensor, scaling: float, num_positions: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, 2 * len(inv_freq)] of positions 0 .. num_positions - 1, as transformers' forward."""
    inv_freq = inv_freq.to(device=like.device, dtype=torch.float32)
    positions = torch.arange(num_positions, device=like.device)
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(like.dtype), (emb.sin() * scaling).to(like.dtype)


def _auto_owned(model: Any) -> bool:
    """Whether "auto" takes the owned decoder on CUDA: wherever it runs the model. A vision-language model's text
    stack included (images, M-RoPE, DeepStack: exact against `generate` in fp32 on both decoders on the CPU and, since
    the GPU suite's `testsF` of 2026-12-06 on an H100, on CUDA); its `config` is the language model's, so the check
    asks the model, not a `vision_config` the text config never has."""
    return unsupported_reason(model) is None


def build_decoder(
    model,
    choice: str,
    device: torch.device,
    max_model_len: int,
    use_triton: bool,
    gemm: str = "cublas",
    max_num_tokens: int = 0,
    deterministic: bool = False,
    tp: TensorParallel | None = None,
):
    """The owned decoder for `choice` ("auto": owned on CUDA when supported, and for longrope on any device), or None
    for transformers'.
    `gemm` is EngineConfig.decode_gemm: whether small steps take kernels/decode_gemm.py's path. A model with FP8
    linears takes it with "triton" only (their GEMMs then quant/small_step.py's); "auto" keeps its FP8 GEMMs
    (quantization kernel + cuBLASLt) until the H200 has measured the FP8 small-step path faster.
    `max_num_tokens`: the most tokens a step holds (sizes an MoE model's expert workspace on CUDA).
    `deterministic`: always the owned decoder, with batch-invariant ops (deterministic.py).
    `tp`: `model` is one rank's shard (models/shard_model.py): always the owned decoder, with its collectives."""
    assert choice in DECODERS, f"decoder must be one of {DECODERS}, got {choice!r}"
    assert gemm in DECODE_GEMMS, f"decode_gemm must be one of {DECODE_GEMMS}, got {gemm!r}"
    latent = bool(getattr(model.config, "kv_lora_rank", None))
    if latent:
        prefill_choice()  # a bad CBQ_MLA_PREFILL fails here, at start, in one line, not in every prefill step
    if latent and (
        choice == "hf"
        or deterministic
        or (choice == "auto" and (device.type != "cuda" or tp is not None or not _auto_owned(model)))
    ):
        # Latent attention on transformers' layers with cbq's attention: "auto" on the CPU and on tensor-parallel
        # shards (whose collectives then sit in their modules: models/shard_model.py). "auto" in one CUDA process
        # takes the owned decoder (latent_layer.py, the owned MoE path): exact against `generate` in fp32 on CUDA
        # and 1.36x the W1 output rate of transformers' layers on the DeepSeek-V2-Lite shape (H100, 2026-12-06,
        # `run_gpu.sh mlagpu w1mlaowned`). Its ranks run the owned decoder exactly over gloo on the CPU, not yet
        # measured on GPUs: `--decoder owned` takes it there.
        return _latent_attention_model(model, choice, deterministic, tp)
    if deterministic:
        use_triton = use_triton and decode_gemm.HAVE_TRITON
        invariant.check_supported(choice, unsupported_reason(model))
        decoder = OwnedDecoder(
            model, max_model_len, use_triton, decode_gemm.pdl_usable(device), max_num_tokens, deterministic=True,
            tp=tp,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return decoder
    if longrope_original_len(model.config) is not None:  # per-sequence tables: the owned decoder on every device
        if choice == "hf":
            raise ValueError(
                "decoder 'hf' cannot run longrope exactly (transformers' forward picks one rotary table for the whole "
                "batch): use decoder 'auto' or 'owned'"
            )
        choice = "owned"
    if tp is None and (choice == "hf" or (choice == "auto" and (device.type != "cuda" or not _auto_owned(model)))):
        return None
    small_step_gemm = gemm != "cublas" and use_triton and decode_gemm.usable(device, model.dtype)
    if gemm == "triton" and not small_step_gemm:
        raise ValueError(
            "decode_gemm 'triton' needs CUDA sm90+ with Triton, bf16 or fp16 (or FP8) weights, and fused kernels on"
        )
    decoder = OwnedDecoder(model, max_model_len, use_triton, small_step_gemm, max_num_tokens, tp=tp)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # return the un-fused weights' blocks, so KV sizing sees them free
    return decoder
