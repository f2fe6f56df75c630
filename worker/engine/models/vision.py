"""A vision-language checkpoint as the engine runs it (families/spec.py `VisionSpec`): transformers' whole model,
behind the face of a causal LM whose `config` is its language model's, so that the engine's sizing (KV cache,
vocabulary, context) reads the text model as for any other family.

Owns nothing beyond the wrapped model. The owned decoder reads the language model's weights through the whole
model (`family_root`: the family's paths start there). `forward` is transformers' language model's (token ids or input embeddings, with
cbq's attention metadata, and for DeepStack the features added after its first layers); `encode_images` (the vision
tower and its projector) and `embed_tokens` are what the engine's image inputs (multimodal.py) run before it;
`image_format` names the family's image processing, `deepstack_levels` how many DeepStack levels each image row has.
"""

from __future__ import annotations

from typing import Any

import torch

from ..families.spec import Family, VisionSpec
from .vision_attention import use_packed_attention

# Pixtral patches one tower call takes at most (two 1024x768 images: 2 x 3,942 patches of 14 pixels): its attention's
# block-diagonal mask and scores grow with the square of a call's patches (`_pixtral_calls`)
PIXTRAL_PATCHES_PER_CALL = 8192


class VisionLanguageModel(torch.nn.Module):
    """transformers' vision-language model, its language model's config as `config`."""

    def __init__(self, whole: Any, spec: VisionSpec):
        super().__init__()
        self.whole = whole
        self.image_format = spec.images  # multimodal.IMAGE_FORMATS
        self.config = whole.config.get_text_config()  # the object the language model reads
        self.config.tie_word_embeddings = whole.config.tie_word_embeddings  # the whole decides what was saved
        self.vision_config = whole.config.vision_config
        self.image_token_id: int = whole.config.image_token_id
        # Qwen3-VL's DeepStack levels (0: none): `encode_images` returns them beside the embeddings, row by row
        self.deepstack_levels = len(self.vision_config.deepstack_visual_indexes) if spec.deepstack else 0
        self.name_or_path: str = whole.name_or_path  # its processor's files (preprocessor_config.json)
        self.generation_config = whole.generation_config

    @property
    def dtype(self) -> torch.dtype:
        return self.whole.dtype

    @property
    def vision_tower(self) -> torch.nn.Module:
        model = self.whole.model
        return model.visual if hasattr(model, "visual") else model.vision_tower

    def encode_images(self, pixels: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
        """The images' embeddings in the language model's space, [sum of their tokens, hidden], in image order.
        `pixels`: the processor's (Qwen-VL: every image's patches, with `grids` [N, 3]; Gemma 3: [N, 3, S, S];
        Pixtral: [N, 3, H, W] zero-padded, with `grids` [N, 2], each image's height and width).
        With DeepStack levels, [sum of their tokens, 1 + levels, hidden]: each row's embedding, then its features
        of each level (kept together, so that every row of an image carries all it feeds the language model)."""
        tower = self.vision_tower
        pixels = pixels.to(self.whole.dtype)
        if self.image_format == "qwen_vl":
            out = tower(pixels, grid_thw=grids)
            if self.deepstack_levels:
                return torch.stack([out.pooler_output, *out.deepstack_features], dim=1)
            return out.pooler_output  # merged patches, projected
        if self.image_format == "pixtral":  # Mistral 3: Pixtral's features, in calls of bounded patch counts
            assert grids is not None, "Pixtral's images come with their sizes"
            return torch.cat([self._pixtral(pixels[group], grids[group]) for group in self._pixtral_calls(grids)])
        # Gemma 3: SigLIP's last hidden state, pooled to mm_tokens_per_image and projected (transformers'
        # get_image_features, called through its parts: what it returns changed across transformers 5 releases)
        hidden = tower(pixel_values=pixels).last_hidden_state
        return self.whole.model.multi_modal_projector(hidden).flatten(0, 1)

    def _pixtral_calls(self, sizes: torch.Tensor) -> list[slice]:
        """Consecutive runs of images whose patches add up to at most PIXTRAL_PATCHES_PER_CALL (one image at least):
        transformers' Pixtral attends over all the patches of a call at once under a block-diagonal mask, so one
        call over a step's eight 1024x768 images (~32k patches) would build a 1e9-entry mask and score every pair."""
        patch = self.vision_config.patch_size
        counts = [(int(h) // patch) * (int(w) // patch) for h, w in sizes.tolist()]
        calls, start, total = [], 0, 0
        for i, count in enumerate(counts):
            if i > start and total + count > PIXTRAL_PATCHES_PER_CALL:
                calls.append(slice(start, i))
                start, total = i, 0
            total += count
        calls.append(slice(start, len(counts)))
        return calls

    def _pixtral(self, pixels: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """One call of Pixtral's tower, patch merger and projector over some images: [their tokens, hidden]."""
        out = self.whole.model.get_image_features(
            pixel_values=pixels, image_sizes=sizes, vision_feature_layer=self.whole.config.vision_feature_layer
        )
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.whole.get_input_embeddings()

    def set_attn_implementation(self, implementation: str) -> None:
        """The language model's attention; the vision tower keeps its own (cbq's paged attention is causal, over
        the KV cache: the tower attends within each image, and within its windows): Qwen-VL's towers one packed
        call a block (vision_attention.py, where transformers' sdpa loops over every window and image), the
        others sdpa."""
        self.whole.set_attn_implementation({"text_config": implementation, "vision_config": "sdpa"})
        if self.image_format == "qwen_vl":
            use_packed_attention(self.vision_config)

    def forward(
        self,
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' forward without images: `input_ids` or `inputs_embeds` [1, T(, H)], `position_ids`
        [1, T] (text: the three rotary rows alike) or [3, 1, T] (M-RoPE), `logits_to_keep`, cbq's metadata.

        DeepStack (`deepstack_visual_embeds`: per level [image rows, hidden], added to decoder layer level's output
        at the rows `visual_pos_masks` [1, T] marks, in row order): transformers' Qwen3VLModel.forward derives
        these from pixel values only, and a step's image rows come as embeddings (a chunk may hold part of an
        image), so its language model and lm_head are called directly, as Qwen3VLForConditionalGeneration does."""
        if deepstack_visual_embeds is None:
            return self.whole(**kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        out = self.whole.model.language_model(
            visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack_visual_embeds, **kwargs
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.whole.lm_head(out.last_hidden_state[:, keep, :]))


def family_root(model: Any) -> Any:
    """The module a family's paths (families/spec.py `layers_path`, `embed_path`, ...) start from, whose config
    `family_for` reads and whose output embeddings are the LM head: transformers' whole vision-language model for
    a `VisionLanguageModel` (the owned decoder runs its language model), else the model itself."""
    return model.whole if isinstance(model, VisionLanguageModel) else model


def load_vision_model(
    name_or_path: str, family: Family, generation_config: Any, dtype: torch.dtype, device: torch.device
) -> VisionLanguageModel:
    """The whole checkpoint (vision tower, projector and language model) as `family.vision` names its class."""
    import transformers

    assert family.vision is not None, f"{family.name} takes no images"
    model_class = getattr(transformers, family.vision.model_class)
    whole = model_class.from_pretrained(
        name_or_path, generation_config=generation_config, dtype=dtype, trust_remote_code=False
    ).to(device)
    return VisionLanguageModel(whole, family.vision)
