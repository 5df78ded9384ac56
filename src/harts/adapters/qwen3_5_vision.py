"""The multimodal ``qwen3_5`` and ``qwen3_5_moe`` models (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): what harts reads of them beside the text adapter.

The language model is ``model.model.language_model`` (the text causal LM's decoder, run by
:class:`~harts.adapters.qwen3_5.Qwen3_5Adapter` over the forest), the vision tower
``model.model.visual``. Image features and M-RoPE positions come from the stock model's own
``get_image_features`` and ``get_rope_index``, with ``mm_token_type_ids`` made as the processor
makes them (1 where the token is the image token); videos are refused.
"""

from __future__ import annotations

import torch

from harts.adapters.vision_language import VisionLanguage

__all__ = ["Qwen3_5VisionLanguage", "TINY_VISION"]

# The tiny vision tower of the tests and benchmarks: two blocks, 32 wide, patches of 2 x 2 pixels
# over 2 frames and 3 channels (rows of 24 values), 2 x 2 patches merged into one image token.
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
)
# Their special tokens, at the top of the tiny 128-token vocabulary.
TINY_TOKENS = dict(vision_start_token_id=122, vision_end_token_id=123, image_token_id=124, video_token_id=125)


def _patch_area(patch_size) -> int:
    if isinstance(patch_size, (list, tuple)):
        return int(patch_size[0]) * int(patch_size[-1])
    return int(patch_size) ** 2


class Qwen3_5VisionLanguage(VisionLanguage):
    def __init__(self, model_type: str):
        self.model_types = (model_type,)

    def language_model(self, model):
        return model.model.language_model

    def vision_tower(self, model):
        return model.model.visual

    def image_token_id(self, config) -> int:
        return int(config.image_token_id)

    def image_placeholder(self, config, tokens: int) -> list[int]:
        image = self.image_token_id(config)
        return [int(config.vision_start_token_id), *[image] * tokens, int(config.vision_end_token_id)]

    def refused_token_ids(self, config) -> dict[int, str]:
        return {int(config.video_token_id): "video token (videos are not run by harts)"}

    def merge_size(self, config) -> int:
        return int(config.vision_config.spatial_merge_size)

    def pixel_row_width(self, config) -> int:
        vision = config.vision_config
        return int(vision.in_channels) * int(vision.temporal_patch_size) * _patch_area(vision.patch_size)

    def rope_index(self, model, input_ids, grid_thw):
        ids = input_ids[None]
        mm_token_type_ids = (ids == self.image_token_id(model.config)).to(torch.int)
        positions, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid_thw if grid_thw.numel() else None
        )
        return positions[:, 0]

    def stock_inputs(self, config, input_ids, pixel_values, grid_thw) -> dict:
        mm_token_type_ids = (input_ids == self.image_token_id(config)).to(torch.int)
        return {
            "input_ids": input_ids,
            "pixel_values": pixel_values,
            "image_grid_thw": grid_thw,
            "mm_token_type_ids": mm_token_type_ids,
        }

    def image_features(self, model, pixel_values, grid_thw):
        out = model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
        return torch.cat(out.pooler_output, dim=0)

    def image_flops(self, model, grid_thw) -> int:
        """The tower's matmuls: the patch embedding and every block's projections per patch, the
        block's attention over the image's frame (``h * w`` keys per patch, queries and values of
        the block's width), and the merger per image token."""
        tower = self.vision_tower(model)
        t, h, w = (int(x) for x in grid_thw)
        patches, merge = t * h * w, int(tower.spatial_merge_size)

        def matmul_weights(module) -> int:
            return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

        per_patch = 2 * tower.patch_embed.proj.weight.numel()
        for block in tower.blocks:
            per_patch += 2 * matmul_weights(block) + 4 * block.attn.dim * h * w
        return patches * per_patch + patches // merge**2 * 2 * matmul_weights(tower.merger)

    def tiny_config(self, text_config, **vision_overrides):
        """A toy multimodal configuration around the family's tiny ``text_config``: the tower of
        :data:`TINY_VISION` (keywords override its fields), special tokens :data:`TINY_TOKENS`."""
        from transformers import AutoConfig

        vision = dict(TINY_VISION, out_hidden_size=text_config.hidden_size, **vision_overrides)
        config_class = type(AutoConfig.for_model(self.model_types[0]))
        return config_class(text_config=text_config.to_dict(), vision_config=vision, **TINY_TOKENS)
