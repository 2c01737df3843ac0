"""lightning_gkd.toy.shapes: the synthetic shape-naming vision task, its splits and its on-disk form."""

import json

import numpy as np
import pytest
from PIL import Image

from lightning_gkd.evaluation import exact_match
from lightning_gkd.toy import shape_rows as exported_shape_rows
from lightning_gkd.toy.shapes import (
    COLOURS,
    IMAGE_SIZE,
    QUESTION,
    QUESTIONS,
    SHAPES,
    SPLIT_SIZES,
    render_shape,
    shape_rows,
    shape_specs,
    write_shape_files,
)


def image_of(row) -> Image.Image:
    return row["messages"][0]["content"][0]["image"]


def pixels(row) -> np.ndarray:
    return np.asarray(image_of(row))


def foreground(image: np.ndarray) -> np.ndarray:
    """The mask of the shape's pixels: every pixel that is not grey (no shape colour is grey), after checking that
    the grey background is one uniform level."""
    grey = (image[..., 0] == image[..., 1]) & (image[..., 1] == image[..., 2])
    assert len(np.unique(image[grey][:, 0])) == 1
    return ~grey


def fill_ratio(mask: np.ndarray) -> float:
    ys, xs = np.nonzero(mask)
    return mask.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))


def shape_from_fill(ratio: float) -> str:
    return "square" if ratio > 0.95 else "circle" if ratio > 0.65 else "triangle"


def test_rows_are_multimodal_chat_rows_whose_prompt_is_always_the_same():
    rows = shape_rows("val")
    assert exported_shape_rows is shape_rows
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        image_part, text_part = user["content"]
        assert image_part["type"] == "image" and isinstance(image_part["image"], Image.Image)
        assert image_part["image"].size == (IMAGE_SIZE, IMAGE_SIZE) and image_part["image"].mode == "RGB"
        assert text_part == {"type": "text", "text": QUESTION}
        colour, shape = assistant["content"].split()
        assert colour in COLOURS and shape in SHAPES
        assert row["answer"] == assistant["content"]
    assert {row["answer"] for row in rows} == {f"{c} {s}" for c in COLOURS for s in SHAPES}
    assert exact_match([row["answer"] for row in rows], [r["answer"] + " " for r in rows]) == 1.0


def test_split_sizes_and_short_splits():
    for split, size in SPLIT_SIZES.items():
        assert len(shape_rows(split)) == size
    assert len(shape_rows("train", num_rows=50)) == 50
    assert shape_specs("train", num_rows=50) == shape_specs("train")[:50]
    with pytest.raises(ValueError, match="Unknown toy split"):
        shape_rows("dev")


def test_same_seed_gives_identical_pixels_and_another_seed_does_not():
    first, again = shape_rows("test", num_rows=40), shape_rows("test", num_rows=40)
    assert [r["answer"] for r in first] == [r["answer"] for r in again]
    assert all(np.array_equal(pixels(a), pixels(b)) for a, b in zip(first, again, strict=True))
    assert image_of(first[0]) is not image_of(again[0])  # each call hands out fresh images
    other = shape_rows("test", num_rows=40, seed=1)
    assert not all(np.array_equal(pixels(a), pixels(b)) for a, b in zip(first, other, strict=True))


def test_splits_are_disjoint():
    keys = {split: {spec[:6] for spec in shape_specs(split)} for split in SPLIT_SIZES}
    for split, size in SPLIT_SIZES.items():
        assert len(keys[split]) == size
    assert not keys["train"] & keys["val"]
    assert not keys["train"] & keys["test"]
    assert not keys["val"] & keys["test"]


@pytest.mark.parametrize("image_size", [IMAGE_SIZE, 16, 48])
def test_the_image_shows_the_colour_and_shape_the_answer_names(image_size):
    for row in shape_rows("test", num_rows=120, image_size=image_size):
        image = pixels(row)
        assert image.shape == (image_size, image_size, 3)
        mask = foreground(image)
        colour, shape = row["answer"].split()
        assert {tuple(v) for v in image[mask]} == {COLOURS[colour]}
        assert shape_from_fill(fill_ratio(mask)) == shape


def test_fill_ratios_of_the_three_shapes():
    ratios = {
        shape: fill_ratio(foreground(np.asarray(render_shape(shape, "blue", 3, 5, 20, 230, 32)))) for shape in SHAPES
    }
    assert ratios["square"] == 1.0
    assert ratios["circle"] == pytest.approx(0.785, abs=0.04)
    assert ratios["triangle"] == pytest.approx(0.5, abs=0.06)
    with pytest.raises(ValueError, match="shape must be one of"):
        render_shape("hexagon", "red", 0, 0, 10, 220, 32)


def test_mixed_questions_ask_for_the_colour_or_the_shape_on_some_rows():
    rows = shape_rows("val", mixed=True)
    full = shape_rows("val")
    asked = {row["messages"][0]["content"][1]["text"] for row in rows}
    assert asked == set(QUESTIONS)
    for row, plain in zip(rows, full, strict=True):
        assert np.array_equal(pixels(row), pixels(plain))  # same images, only the questions differ
        colour, shape = plain["answer"].split()
        question = row["messages"][0]["content"][1]["text"]
        assert row["answer"] == {QUESTIONS[0]: plain["answer"], QUESTIONS[1]: colour, QUESTIONS[2]: shape}[question]


@pytest.mark.parametrize("absolute_paths", [False, True])
def test_jsonl_round_trip(tmp_path, absolute_paths):
    jsonl = write_shape_files(tmp_path, "val", num_rows=25, absolute_paths=absolute_paths)
    assert jsonl == tmp_path / "val.jsonl"
    rows = shape_rows("val", num_rows=25)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 25
    for line, row in zip(lines, rows, strict=True):
        image_part, text_part = line["messages"][0]["content"]
        assert set(image_part) == {"type", "path"} and image_part["type"] == "image"
        path = tmp_path / image_part["path"]  # an absolute path replaces tmp_path
        assert path.is_absolute() == absolute_paths or not absolute_paths
        assert path.is_file()
        with Image.open(path) as loaded:
            assert np.array_equal(np.asarray(loaded.convert("RGB")), pixels(row))
        assert text_part == {"type": "text", "text": QUESTION}
        assert line["messages"][1] == {"role": "assistant", "content": row["answer"]}
        assert line["answer"] == row["answer"]
