"""Images in chat rows (the transformers multimodal chat format): which parts of a message are images, where each
image comes from, and loading it as a PIL image.

A message's ``content`` is a string or a list of parts: ``{"type": "text", "text": ...}`` and ``{"type": "image",
...}``. An image part holds its image under ``image`` (a PIL image, raw ``bytes``, a ``{"bytes", "path"}`` dict as
``datasets`` stores images, or a local file path), ``path`` or ``url`` (a local file; ``file://`` allowed), or
nothing: then the row's ``images`` column (TRL's datasets) gives the images of such parts in order.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

IMAGE_PART_TYPES = ("image", "image_url")
_PAYLOAD_KEYS = ("image", "path", "url", "image_url")


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The image parts of ``messages``, in order."""
    return [
        part
        for message in messages
        if not isinstance(message.get("content"), str)
        for part in (message.get("content") or ())
        if is_image_part(part)
    ]


def row_has_images(row: Mapping[str, Any]) -> bool:
    """Whether a chat row holds an image (an image part in a message, or a non-empty ``images`` column)."""
    return bool(image_parts(row.get("messages") or ())) or bool(row.get("images"))


def _payload(part: Mapping[str, Any]) -> Any:
    for key in _PAYLOAD_KEYS:
        value = part.get(key)
        if isinstance(value, Mapping) and key == "image_url":  # OpenAI style {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    return None


def image_sources(row: Mapping[str, Any]) -> list[Any]:
    """Each image of ``row`` in the order its parts appear: the part's own payload, else the next entry of the row's
    ``images`` column. ``ValueError`` when the counts do not match (parts without a payload vs ``images``)."""
    parts = image_parts(row.get("messages") or ())
    column = list(row.get("images") or ())
    sources: list[Any] = []
    taken = 0
    for part in parts:
        payload = _payload(part)
        if payload is None:
            if taken >= len(column):
                raise ValueError(
                    f"has {len(parts)} image parts, {sum(_payload(p) is None for p in parts)} of them without an "
                    f"image, but its 'images' column holds {len(column)}: give each image part its image "
                    "('image', 'path' or 'url') or one 'images' entry per part without one."
                )
            payload = column[taken]
            taken += 1
        sources.append(payload)
    if taken < len(column):
        raise ValueError(
            f"has {len(column)} entries in its 'images' column but only {taken} image parts without an image: add "
            "an {'type': 'image'} part to a message for each (where the image goes in the prompt)."
        )
    return sources


def _local_path(value: str | Path) -> Path:
    text = str(value)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(f"image {text[:80]!r} is a URL: download it and give the local file's path instead.")
    return Path(text).expanduser()


def check_image_source(source: Any) -> None:
    """Cheap checks before training (no decoding): a path must name an existing file, other payloads a known type."""
    if isinstance(source, (Image.Image, bytes, bytearray)):
        return
    if isinstance(source, Mapping):
        if source.get("bytes") is not None:
            return
        source = source.get("path")
    if isinstance(source, (str, Path)):
        path = _local_path(source)
        if not path.is_file():
            raise ValueError(f"image file {str(path)!r} does not exist.")
        return
    raise ValueError(
        f"image of type {type(source).__name__} is not a PIL image, bytes, a {{'bytes', 'path'}} dict or a path."
    )


def load_image(source: Any) -> Image.Image:
    """A PIL image in RGB from any payload ``check_image_source`` accepts."""
    check_image_source(source)
    if isinstance(source, Mapping):
        source = source["bytes"] if source.get("bytes") is not None else source["path"]
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, (bytes, bytearray)):
        image = Image.open(io.BytesIO(source))
    else:
        image = Image.open(_local_path(source))
    return image.convert("RGB") if image.mode != "RGB" else image


def row_images(row: Mapping[str, Any]) -> list[Image.Image]:
    """The row's images, loaded, in the order their parts appear."""
    return [load_image(source) for source in image_sources(row)]


def text_only_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` whose part lists hold only text parts, joined into string contents (for a text-only template)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) and content is not None:
            content = "".join(str(part.get("text", "")) for part in content if not is_image_part(part))
        out.append({**message, "content": content})
    return out
