"""Vision-language models as users load them: the text causal LM inside, beside its vision tower.

A multimodal checkpoint (``Qwen3_5ForConditionalGeneration``, say) holds a language model, a head
and a vision tower; each image token of the text stands for one row of the tower's output for its
image, and positions are the model's multimodal rotary positions (M-RoPE: three axes, an image's
tokens laid out on its grid, the text after it continuing from the grid's extent, not from the
token count). harts runs the language model over the forest with the family's text adapter,
through a :class:`TextView`: a module whose ``config``, ``model`` and ``lm_head`` are the text
causal LM's, so everything that reads a causal LM reads it unchanged, and whose
``vision_language`` names the whole model, from which the image features and the positions come
(:mod:`harts.runtime.image_forest`, :mod:`harts.runtime.image_inputs`).

What a family declares of its multimodal model is a :class:`VisionLanguage`
(``FamilyAdapter.vision_language``): where the language model and the tower sit, the image token,
the processor's row layout, and the stock functions for the image features and the positions, so
that those are the stock model's own computations.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VisionLanguage", "TextOnly", "TextView", "text_view"]


class VisionLanguage:
    """A family's multimodal model: what harts reads of it (subclassed in the family's adapter).

    ``model_types``: the config types of the multimodal wrapper (``qwen3_5``), whose
    ``text_config`` is the text causal LM's. Every method takes the whole multimodal model or its
    config.
    """

    model_types: tuple[str, ...] = ()
    # whether harts runs the model's images; where it does not, the multimodal model runs as its
    # text causal LM on forests without images, and :meth:`refuse_images` says what is missing
    runs_images: bool = True

    def refuse_images(self, config) -> None:
        """ValueError naming what harts lacks to run this family's images (nothing where it runs them)."""

    def wraps(self, model: nn.Module) -> bool:
        """Whether ``model`` is the multimodal wrapper (its config and its modules; not the text
        causal LM, whatever its config)."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in self.model_types or not hasattr(config, "text_config"):
            return False
        try:
            parts = (self.language_model(model), self.vision_tower(model))
        except AttributeError:
            return False
        return all(isinstance(part, nn.Module) for part in parts)

    def language_model(self, model: nn.Module) -> nn.Module:
        """The decoder (embedding, layers, final norm, rotary) that the text adapter runs."""
        raise NotImplementedError

    def vision_tower(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def image_token_id(self, config) -> int:
        raise NotImplementedError

    def image_placeholder(self, config, tokens: int) -> list[int]:
        """The ids the processor writes for an image of ``tokens`` image tokens (its markers
        around them): what synthetic rollouts put in the text."""
        raise NotImplementedError

    def refused_token_ids(self, config) -> dict[int, str]:
        """Token ids of inputs harts does not run (videos), each with what it stands for."""
        return {}

    def merge_size(self, config) -> int:
        """Patches per image token along each spatial axis: an image of grid (t, h, w) has
        ``t * h * w / merge_size**2`` tokens."""
        raise NotImplementedError

    def pixel_row_width(self, config) -> int:
        """Values per row of the processor's ``pixel_values`` (one patch)."""
        raise NotImplementedError

    def rope_index(self, model: nn.Module, input_ids: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[3, L] rotary positions of one trajectory ``input_ids`` [L] whose images have grids
        ``grid_thw`` [n, 3], as the stock forward computes them."""
        raise NotImplementedError

    def image_features(
        self, model: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """[F, D] the tower's output for images ``grid_thw`` [n, 3] whose rows are ``pixel_values``
        [P, W] (the stock forward's ``get_image_features``), image after image, in the text
        model's hidden size: the rows that replace the image tokens' embeddings."""
        raise NotImplementedError

    def image_flops(self, model: nn.Module, grid_thw) -> int:
        """Forward FLOPs of the tower on one image of grid (t, h, w) (the FLOP model's term)."""
        raise NotImplementedError

    def stock_inputs(
        self, config, input_ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> dict:
        """The stock forward's keyword arguments for one trajectory ``input_ids`` [1, L] with its
        images (rows ``pixel_values`` [P, W], grids ``grid_thw`` [n, 3]), as the processor gives
        them: what ``RunConfig(verify=True)`` runs the whole model on."""
        return {"input_ids": input_ids, "pixel_values": pixel_values, "image_grid_thw": grid_thw}


class TextOnly(VisionLanguage):
    """A multimodal model whose images harts does not run: its language model (``model.model.
    language_model``) and head on forests without images; images refused, naming the family."""

    runs_images = False

    def __init__(self, family: str, model_types: tuple[str, ...]):
        self.family, self.model_types = family, model_types

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def image_token_id(self, config) -> int:
        return config.image_token_id

    def refused_token_ids(self, config) -> dict[int, str]:
        return {config.video_token_id: "video token"}

    def refuse_images(self, config) -> None:
        raise ValueError(
            f"{self.family}: rollouts with images are not supported: harts does not run the {self.family} "
            f"vision tower over a forest's images, nor place its features at the image tokens; train the "
            f"language model on text rollouts"
        )


class TextView(nn.Module):
    """The text causal LM of a multimodal ``model``, as harts runs it.

    ``config``, ``model`` (the language model) and ``lm_head`` are the text causal LM's, so the
    family's text adapter and every check read it as they read ``*ForCausalLM``; its parameters
    are theirs. The vision tower is not a submodule (harts calls it through ``vision_language``),
    and ``multimodal`` is the whole model, not a submodule either, so nothing is reached twice.
    ``training`` is the whole model's.
    """

    def __init__(self, model: nn.Module, vision_language: VisionLanguage):
        super().__init__()
        self.model = vision_language.language_model(model)
        self.lm_head = model.lm_head
        self.config = model.config.text_config
        object.__setattr__(self, "multimodal", model)
        object.__setattr__(self, "vision_language", vision_language)

    @property
    def training(self) -> bool:  # the whole model's mode (dropout, checkpointing)
        multimodal = self.__dict__.get("multimodal")
        return bool(multimodal.training) if multimodal is not None else False

    @training.setter
    def training(self, mode: bool) -> None:
        """nn.Module sets its own flag on construction and on ``train()``; the view has none."""

    @property
    def vision_tower(self) -> nn.Module:
        return self.vision_language.vision_tower(self.multimodal)


def text_view(model: nn.Module, vision_language: VisionLanguage | None) -> TextView | None:
    """``model``'s :class:`TextView` when it is the multimodal wrapper ``vision_language``
    describes; None otherwise."""
    if vision_language is None or not vision_language.wraps(model):
        return None
    return TextView(model, vision_language)
