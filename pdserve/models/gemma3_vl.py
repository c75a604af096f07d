"""Gemma 3 with its SigLIP tower (Gemma3ForConditionalGeneration): the Gemma 3 text model
(pdserve.models.gemma3) whose image placeholder tokens take the tower's embeddings
(pdserve.models.gemma3_vision), with 1-D positions.

Two things the engine must honour, which this model declares as attributes:
- bidirectional_images: each image's placeholder tokens attend to one another in both
  directions (pdserve.models.image_masks), so a query inside an image sees keys up to the
  image's end. The model runner passes those per-query key ends to the prefill kernel, the
  scheduler never cuts an image across prefill chunks and never takes a prefix-cache hit that
  ends inside one (the image's earlier tokens' KV depends on its later tokens);
- uses_mrope False: the runner keeps its plain positions.

The checkpoint keeps transformers' names: the language model under language_model.model.*
(transformers 5 saves it so; model.language_model.* is its module path), the tower and the
projector under vision_tower.* and multi_modal_projector.* (read by load_image_encoder).
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models import gemma3
from pdserve.models.decoder import DecoderModel
from pdserve.models.gemma3_vision import load_image_encoder, vision_spec
from pdserve.protocol.multimodal import ImageInput

ARCHITECTURE = "Gemma3ForConditionalGeneration"
# After checkpoint_tensors took off a leading "model.": the language model's prefixes, longest first.
TEXT_PREFIXES = ("language_model.model.", "language_model.")


def check_config(config) -> None:
    """config: the text config standing for the model (loader.flatten_multimodal_config)."""
    gemma3.check_config(config)
    vision_spec(config.multimodal_config)


def text_name(name: str) -> str | None:
    """The language model's parameter name of a checkpoint tensor; None for the tower's."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("lm_head."):
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


class Gemma3VLModel(DecoderModel):
    is_multimodal = True
    uses_mrope = False
    bidirectional_images = True

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """[image.length, hidden]: the image's embeddings, one per placeholder token."""
        weight = self.encoder.multi_modal_projector.mm_input_projection_weight
        pixels = torch.tensor(image.pixels(), dtype=weight.dtype, device=weight.device)  # a copy: read-only bytes
        out = self.encoder(pixels)
        if out.shape[0] != image.length:
            raise ValueError(f"the image gives {out.shape[0]} embeddings for {image.length} placeholder tokens")
        return out


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> Gemma3VLModel:
    model = gemma3.build_model(config, files, dtype, device, model_class=Gemma3VLModel, rename=text_name)
    mm = config.multimodal_config
    model.image_token_id = int(mm.image_token_id)
    model.encoder = load_image_encoder(mm, files, dtype, device)
    return model
