"""A small synthetic vision task for tiny vision-language models: name the one shape drawn in an image.

Each image (``IMAGE_SIZE`` px square by default) is a plain light-grey background (its grey level varies from image
to image) with one filled ``circle``, ``square`` or ``triangle`` in one of four colours (``red``, ``green``,
``blue``, ``yellow``), drawn without antialiasing at a random position and size. The prompt text is the same for
every row, so the answer can only come from the image::

    {"messages": [
        {"role": "user", "content": [{"type": "image", "image": <PIL.Image>},
                                     {"type": "text", "text": "What is in the image?"}]},
        {"role": "assistant", "content": "red square"}],
     "answer": "red square"}

With ``mixed=True`` each row instead asks one of three questions, drawn per row: what is in the image
("red square"), its colour ("red") or its shape ("square"). Answers are checked by exact match
(``lightning_gkd.evaluation.exact_match``).

Splits are drawn from one fixed-seed stream, test first, then val, then train, and no (shape, colour, x, y, size,
background) tuple repeats across splits, so growing train never changes the held-out sets.
``write_shape_files`` writes a split to disk the way a user's dataset looks: PNG files and a JSONL file whose image
parts hold ``{"type": "image", "path": ...}``.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIZE = 32
SPLIT_SIZES = {"train": 4000, "val": 200, "test": 300}
_SPLIT_ORDER = ("test", "val", "train")

SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 20),
}
BACKGROUND_LEVELS = range(200, 246)  # light grey, (level, level, level)

QUESTION = "What is in the image?"
COLOUR_QUESTION = "What colour is the shape?"
SHAPE_QUESTION = "What shape is it?"
QUESTIONS = (QUESTION, COLOUR_QUESTION, SHAPE_QUESTION)

# (shape, colour, x, y, size, background level, question index)
ShapeSpec = tuple[str, str, int, int, int, int, int]


def size_range(image_size: int) -> tuple[int, int]:
    """The smallest and largest side (px, inclusive) a shape may have in an ``image_size`` image."""
    if image_size < 16:
        raise ValueError(f"image_size must be at least 16 px, got {image_size}.")
    return max(8, image_size * 5 // 16), image_size * 3 // 4


def render_shape(shape: str, colour: str, x: int, y: int, size: int, background: int, image_size: int) -> Image.Image:
    """An RGB image: ``shape`` filled with ``COLOURS[colour]`` in the ``size`` px box at (``x``, ``y``) on a
    ``(background,) * 3`` grey ground. Circle: the inscribed disc; triangle: apex at the top middle, base along the
    bottom edge of the box."""
    image = Image.new("RGB", (image_size, image_size), (background,) * 3)
    draw = ImageDraw.Draw(image)
    box = (x, y, x + size - 1, y + size - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y + size - 1), (x + size - 1, y + size - 1), (x + (size - 1) / 2, y)], fill=fill)
    else:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}.")
    return image


def _answer(shape: str, colour: str, question: int) -> str:
    return (f"{colour} {shape}", colour, shape)[question]


@lru_cache(maxsize=32)
def _split_specs(split: str, num_rows: int | None, seed: int, image_size: int, mixed: bool) -> tuple[ShapeSpec, ...]:
    sizes = dict(SPLIT_SIZES)
    if num_rows is not None:
        sizes[split] = num_rows
    low, high = size_range(image_size)
    rng = random.Random(seed)
    question_rng = random.Random(seed + 1_000_003)  # its own stream: ``mixed`` changes the questions, not the images
    seen: set[tuple] = set()
    for name in _SPLIT_ORDER:
        specs: list[ShapeSpec] = []
        while len(specs) < sizes[name]:
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            size = rng.randint(low, high)
            x, y = rng.randint(0, image_size - size), rng.randint(0, image_size - size)
            background = rng.choice(BACKGROUND_LEVELS)
            key = (shape, colour, x, y, size, background)
            if key not in seen:
                seen.add(key)
                specs.append((*key, question_rng.randrange(len(QUESTIONS)) if mixed else 0))
        if name == split:
            return tuple(specs)
    raise AssertionError("unreachable")


@lru_cache(maxsize=8)
def _split_pixels(split: str, num_rows: int | None, seed: int, image_size: int, mixed: bool) -> tuple[bytes, ...]:
    return tuple(
        render_shape(*spec[:6], image_size).tobytes() for spec in _split_specs(split, num_rows, seed, image_size, mixed)
    )


def shape_specs(
    split: str, *, num_rows: int | None = None, seed: int = 0, image_size: int = IMAGE_SIZE, mixed: bool = False
) -> list[ShapeSpec]:
    """What ``shape_rows`` draws, row by row: ``(shape, colour, x, y, size, background, question_index)``."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"Unknown toy split {split!r}; use one of {sorted(SPLIT_SIZES)}.")
    return list(_split_specs(split, num_rows, seed, image_size, mixed))


def shape_rows(
    split: str, *, num_rows: int | None = None, seed: int = 0, image_size: int = IMAGE_SIZE, mixed: bool = False
) -> list[dict]:
    """Rows of ``split`` ("train", "val" or "test") in the transformers multimodal chat format (see the module
    docstring), each with a fresh ``PIL.Image`` (callers may modify rows and images freely).

    ``num_rows`` shortens (or lengthens) the requested split; the splits drawn before it keep their default sizes, so a
    short train split never overlaps the default val/test splits. ``mixed`` asks one of three questions per row
    instead of always ``QUESTION``."""
    specs = shape_specs(split, num_rows=num_rows, seed=seed, image_size=image_size, mixed=mixed)
    pixels = _split_pixels(split, num_rows, seed, image_size, mixed)
    rows = []
    for (shape, colour, *_, question), data in zip(specs, pixels, strict=True):
        answer = _answer(shape, colour, question)
        image = Image.frombytes("RGB", (image_size, image_size), data)
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[question]}],
                    },
                    {"role": "assistant", "content": answer},
                ],
                "answer": answer,
            }
        )
    return rows


def write_shape_files(
    folder: str | Path,
    split: str,
    *,
    num_rows: int | None = None,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    mixed: bool = False,
    absolute_paths: bool = False,
) -> Path:
    """Write ``split`` to ``folder``: its images as ``<folder>/<split>/<index>.png`` and ``<folder>/<split>.jsonl``
    with one row a line, each image part ``{"type": "image", "path": ...}`` (relative to ``folder`` unless
    ``absolute_paths``). Returns the JSONL path."""
    folder = Path(folder)
    (folder / split).mkdir(parents=True, exist_ok=True)
    jsonl = folder / f"{split}.jsonl"
    with jsonl.open("w", encoding="utf-8") as handle:
        for index, row in enumerate(
            shape_rows(split, num_rows=num_rows, seed=seed, image_size=image_size, mixed=mixed)
        ):
            relative = Path(split) / f"{index:05d}.png"
            messages = []
            for message in row["messages"]:
                content = message["content"]
                if isinstance(content, list):
                    parts = []
                    for part in content:
                        if part["type"] == "image":
                            part["image"].save(folder / relative)
                            path = (folder / relative).resolve() if absolute_paths else relative
                            part = {"type": "image", "path": path.as_posix()}
                        parts.append(part)
                    content = parts
                messages.append({"role": message["role"], "content": content})
            handle.write(json.dumps({"messages": messages, "answer": row["answer"]}) + "\n")
    return jsonl
