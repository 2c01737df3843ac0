"""The keyword arguments of a forward over a left-padded batch whose rows may hold images, and the logits of such a
batch (pure torch, no Lightning).

A batch carries its images as ``vision``: one dict per row of the tensors the model's processor returned for that
row's images alone (``pixel_values`` and the family's per-image inputs: ``image_grid_thw``, ``image_sizes``,
``pixel_attention_mask``, ...; an empty dict for a row without images). Per-row dicts keep rows independent: a
grouped generation batch is shuffled and cut, and a sampled batch reuses its prompts' images, by indexing a list.
Inputs that run along the tokens (``token_type_ids`` marking image tokens, ``mm_token_type_ids``) are not carried:
they are derived from the ids at every forward, so they stay true for sampled completions.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gkd.ops.hf.forward import position_ids_from_mask, unwrap

__all__ = [
    "VisionRows",
    "causal_lm_logits",
    "computes_own_positions",
    "config_image_token_id",
    "has_images",
    "image_token_id",
    "lm_inputs",
    "merge_row_inputs",
    "placeholder_token_ids",
    "select_rows",
    "decode_step_inputs",
    "text_position_offsets",
]

#: One dict of image tensors per row (empty for a row without images).
VisionRows = Sequence[Mapping[str, torch.Tensor]]


def has_images(vision: VisionRows | None) -> bool:
    return vision is not None and any(len(row) > 0 for row in vision)


def select_rows(vision: VisionRows | None, index: torch.Tensor | Sequence[int]) -> list[dict[str, torch.Tensor]] | None:
    """The rows ``index`` of ``vision`` (None stays None)."""
    if vision is None:
        return None
    order = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    return [dict(vision[i]) for i in order]


def _pad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``tensor`` zero-padded at the end of every dimension but the first to ``shape[1:]``."""
    pad: list[int] = []
    for have, want in zip(reversed(tensor.shape[1:]), reversed(shape[1:]), strict=True):
        pad += [0, want - have]
    return F.pad(tensor, pad) if any(pad) else tensor


def merge_row_inputs(vision: VisionRows) -> dict[str, torch.Tensor]:
    """The batch's image inputs from per-row dicts: each key's tensors concatenated along their first dimension
    (images, patches or the row itself: a processor's output for one row is its batch of one), other dimensions
    zero-padded to the largest (a row with fewer image crops or tiles; processors pad the same way, and models skip
    all-zero padding images by their masks or sizes). Rows without images contribute nothing.

    Args:
        vision: per-row dicts, e.g. LLaVA's ``{"pixel_values": (n_i, 3, H, W)}``, Qwen2-VL's
            ``{"pixel_values": (patches_i, D), "image_grid_thw": (n_i, 3)}``.

    Returns:
        ``{key: (sum of first dims, *max of the other dims)}``.
    """
    rows = [row for row in vision if row]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    merged: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [row[key] for row in rows if key in row]
        if len(parts) != len(rows):
            raise ValueError(f"image input {key!r} is in {len(parts)} of the {len(rows)} rows with images")
        if any(part.dim() != parts[0].dim() for part in parts):
            raise ValueError(f"image input {key!r} has rows of different ranks: {[tuple(p.shape) for p in parts]}")
        if parts[0].dim() == 0:
            merged[key] = torch.stack(parts)
            continue
        shape = [max(part.shape[d] for part in parts) for d in range(parts[0].dim())]
        merged[key] = torch.cat([_pad_to(part, shape) for part in parts])
    return merged


def image_token_id(model: nn.Module) -> int | None:
    """The id of the token the model replaces by image features (its config's ``image_token_id`` or
    ``image_token_index``), None for a text-only model."""
    return config_image_token_id(getattr(unwrap(model), "config", None))


def placeholder_token_ids(model: nn.Module) -> list[int]:
    """The ids a vision-language model replaces by image or video features (its config's ``image_token_id`` /
    ``image_token_index`` and ``video_token_id``): tokens it reads, never writes. Empty for a text model."""
    config = getattr(unwrap(model), "config", None)
    video = getattr(config, "video_token_id", None)
    return [t for t in (config_image_token_id(config), video if isinstance(video, int) else None) if t is not None]


def config_image_token_id(config: Any) -> int | None:
    """The image token id a model config names (``image_token_id`` or ``image_token_index``), None without one."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _forward_parameters(model: nn.Module) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(unwrap(model).forward).parameters


def computes_own_positions(model: nn.Module) -> bool:
    """Models with multimodal rotary positions (Qwen2-VL's M-RoPE: images take 2-D positions) compute their
    position ids from the ids and the image grid; given plain positions they would be wrong after an image."""
    core = unwrap(model)
    inner = getattr(core, "model", None)
    return callable(getattr(core, "get_rope_index", None)) or callable(getattr(inner, "get_rope_index", None))


def cross_attention_mask(input_ids: torch.Tensor, image_token: int, tile_mask: torch.Tensor) -> torch.Tensor:
    """Which image tiles each token attends to, for a model whose text reaches its images through cross-attention
    (Mllama): image ``i`` of a row is seen from its image token up to the row's next image token that does not
    directly follow it (a run of image tokens shares its end), or to the end of the row; through each of its real
    tiles.

    Args:
        input_ids: ``(B, L)`` tokens, every row with ``n_b`` image tokens.
        image_token: the image token's id.
        tile_mask: ``(B, N, T)`` 1 on the real tiles of each row's images (``aspect_ratio_mask``), ``N >= n_b``.

    Returns:
        ``(B, L, N, T)`` long mask.
    """
    batch, length = input_ids.shape
    spans = torch.zeros(batch, length, tile_mask.shape[1], dtype=torch.long, device=input_ids.device)
    for row in range(batch):
        starts = (input_ids[row] == image_token).nonzero().flatten().tolist()
        ends = [*starts[1:], length] if starts else []
        for index in range(len(starts) - 2, -1, -1):  # a run of image tokens all end where the run's last one does
            if ends[index] == starts[index] + 1:
                ends[index] = ends[index + 1]
        for index, (start, end) in enumerate(zip(starts, ends, strict=True)):
            spans[row, start:end, index] = 1
    return spans[..., None] * tile_mask[:, None].long()


def token_type_inputs(
    model: nn.Module, input_ids: torch.Tensor, images: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The per-token inputs the family's forward takes with images, derived from the ids (and ``images``, the
    batch's merged image inputs): ``mm_token_type_ids`` (Qwen2-VL family) or ``token_type_ids`` (Gemma 3: image
    tokens attend to each other both ways), 1 on the image token and 0 elsewhere; ``cross_attention_mask``
    (Mllama, from its ``aspect_ratio_mask``; see :func:`cross_attention_mask`)."""
    token = image_token_id(model)
    if token is None:
        return {}
    parameters = _forward_parameters(model)
    marks = (input_ids == token).long()
    if "cross_attention_mask" in parameters and "aspect_ratio_mask" in images:
        if images["aspect_ratio_mask"].shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"{type(unwrap(model)).__name__} reads images through cross-attention, one entry per row: every row of "
                "a batch needs an image (this batch has rows without). Give each row an image, or batch the text "
                "rows apart."
            )
        return {"cross_attention_mask": cross_attention_mask(input_ids, token, images["aspect_ratio_mask"])}
    if "mm_token_type_ids" in parameters:
        return {"mm_token_type_ids": marks}
    if "token_type_ids" in parameters:
        return {"token_type_ids": marks}
    return {}


def text_position_offsets(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor | int:
    """``(B, 1)`` what each row's next text position exceeds its count of real tokens by, after the prompt
    ``inputs`` (``lm_inputs``' result): under M-RoPE an image of ``h x w`` merged patches takes ``max(h, w)``
    positions, not ``h * w``; 0 for every other model (and for inputs without images)."""
    if "position_ids" in inputs or not computes_own_positions(model):
        return 0
    core: Any = unwrap(model)
    rope_index = getattr(core, "get_rope_index", None) or core.model.get_rope_index
    arguments = {key: inputs[key] for key in ("image_grid_thw", "video_grid_thw", "mm_token_type_ids") if key in inputs}
    _, deltas = rope_index(inputs["input_ids"], attention_mask=inputs["attention_mask"], **arguments)
    return deltas.to(inputs["input_ids"].device)


def decode_step_inputs(inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """What every decode step after the prompt ``inputs`` (``lm_inputs``' result) passes besides its token: a
    cross-attention model's (Mllama) mask row of the prompt's last token, which each new token repeats (it sees the
    images that token saw); nothing for other models."""
    mask = inputs.get("cross_attention_mask")
    return {} if mask is None else {"cross_attention_mask": mask[:, -1:]}


def lm_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vision: VisionRows | None = None,
) -> dict[str, Any]:
    """``input_ids``, ``attention_mask`` and position ids counted from each row's first real token (left padding);
    with images (``vision``, one dict per row, see the module's docstring) also the merged image inputs and the
    per-token inputs the family needs, and no position ids for a model that computes its own
    (``computes_own_positions``)."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if not has_images(vision):
        inputs["position_ids"] = position_ids_from_mask(attention_mask)
        return inputs
    assert vision is not None
    if len(vision) != input_ids.shape[0]:
        raise ValueError(f"the batch has {input_ids.shape[0]} rows but image inputs for {len(vision)}")
    images = merge_row_inputs(vision)
    inputs.update(images)
    inputs.update(token_type_inputs(model, input_ids, images))
    if not computes_own_positions(model):
        inputs["position_ids"] = position_ids_from_mask(attention_mask)
    return inputs


def causal_lm_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Logits ``(B, L, V)`` of ``model`` on a left-padded batch (``input_ids``, ``attention_mask`` and, for rows with
    images, ``vision``), with positions counted from each row's first real token (the same positions the sampler
    uses)."""
    inputs = lm_inputs(model, batch["input_ids"], batch["attention_mask"], batch.get("vision"))
    return model(**inputs, use_cache=False).logits
