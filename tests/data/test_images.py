"""Images in chat rows (lightning_gkd.data.images): every payload kind an image part may hold, the row's ``images``
column, count mismatches, missing files and URLs, and the text-only view of a conversation."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_gkd.data.images import (
    check_image_source,
    image_parts,
    image_sources,
    load_image,
    row_has_images,
    row_images,
    text_only_messages,
)


def picture(seed: int, size: tuple[int, int] = (6, 4), mode: str = "RGB") -> Image.Image:
    """A small image of random pixels (distinct per seed)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).convert(mode)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def user_row(*parts: dict, images: list | None = None) -> dict:
    row: dict = {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "a square"},
        ]
    }
    if images is not None:
        row["images"] = images
    return row


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Image.Image, Path]:
    image = picture(1)
    path = tmp_path / "one.png"
    image.save(path)
    return image, path


# ---- payload kinds -------------------------------------------------------------------------------------------------


def test_pil_image_is_returned_as_is():
    image = picture(0)
    row = user_row({"type": "image", "image": image})
    assert image_sources(row) == [image]
    (loaded,) = row_images(row)
    assert loaded is image


def test_non_rgb_pil_image_is_converted_to_rgb():
    image = picture(0, mode="RGBA")
    loaded = load_image(image)
    assert loaded.mode == "RGB"
    np.testing.assert_array_equal(pixels(loaded), pixels(image.convert("RGB")))


def test_raw_bytes():
    image = picture(2)
    data = png_bytes(image)
    row = user_row({"type": "image", "image": data})
    assert image_sources(row) == [data]
    (loaded,) = row_images(row)
    assert loaded.mode == "RGB" and loaded.size == (6, 4)
    np.testing.assert_array_equal(pixels(loaded), pixels(image))


def test_bytearray():
    image = picture(2)
    np.testing.assert_array_equal(pixels(load_image(bytearray(png_bytes(image)))), pixels(image))


def test_datasets_dict_with_bytes_wins_over_its_path():
    image = picture(3)
    source = {"bytes": png_bytes(image), "path": "/no/such/file.png"}
    check_image_source(source)  # the bytes are there: the path is not looked at
    np.testing.assert_array_equal(pixels(load_image(source)), pixels(image))


def test_datasets_dict_with_only_a_path(saved):
    image, path = saved
    source = {"bytes": None, "path": str(path)}
    np.testing.assert_array_equal(pixels(load_image(source)), pixels(image))


def test_path_string_and_path_object(saved):
    image, path = saved
    for source in (str(path), path):
        np.testing.assert_array_equal(pixels(load_image(source)), pixels(image))


def test_file_url_is_a_local_path(saved):
    image, path = saved
    row = user_row({"type": "image", "image": f"file://{path}"})
    (loaded,) = row_images(row)
    np.testing.assert_array_equal(pixels(loaded), pixels(image))


def test_home_relative_path_is_expanded(saved, monkeypatch):
    image, path = saved
    monkeypatch.setenv("HOME", str(path.parent))
    np.testing.assert_array_equal(pixels(load_image("~/one.png")), pixels(image))


@pytest.mark.parametrize("key", ["path", "url"])
def test_path_and_url_keys(saved, key):
    image, path = saved
    for value in (str(path), f"file://{path}"):
        row = user_row({"type": "image", key: value})
        assert image_sources(row) == [value]
        np.testing.assert_array_equal(pixels(row_images(row)[0]), pixels(image))


def test_openai_style_image_url_part(saved):
    image, path = saved
    row = user_row({"type": "image_url", "image_url": {"url": f"file://{path}"}})
    assert image_sources(row) == [f"file://{path}"]
    np.testing.assert_array_equal(pixels(row_images(row)[0]), pixels(image))


def test_image_key_is_taken_before_path_and_url(saved):
    image, path = saved
    other = picture(9)
    row = user_row({"type": "image", "image": other, "path": str(path), "url": "https://example.com/x.png"})
    assert image_sources(row) == [other]


# ---- the row's images column ---------------------------------------------------------------------------------------


def test_images_column_fills_payloadless_parts_in_order_across_messages():
    a, b, c, own = picture(10), picture(11), picture(12), picture(13)
    row = {
        "messages": [
            {"role": "system", "content": "Look closely."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": [{"type": "image", "image": own}, {"type": "image"}]},
            {"role": "assistant", "content": "more"},
        ],
        "images": [a, b, c],
    }
    assert [id(source) for source in image_sources(row)] == [id(a), id(b), id(own), id(c)]
    assert len(image_parts(row["messages"])) == 4
    loaded = row_images(row)
    for got, want in zip(loaded, [a, b, own, c], strict=True):
        np.testing.assert_array_equal(pixels(got), pixels(want))


def test_images_column_entries_may_be_any_payload(saved):
    image, path = saved
    raw = picture(20)
    row = user_row({"type": "image"}, {"type": "image"}, images=[str(path), {"bytes": png_bytes(raw), "path": None}])
    first, second = row_images(row)
    np.testing.assert_array_equal(pixels(first), pixels(image))
    np.testing.assert_array_equal(pixels(second), pixels(raw))


def test_more_payloadless_parts_than_images_is_an_error():
    row = user_row({"type": "image"}, {"type": "image", "image": picture(0)}, {"type": "image"}, images=[picture(1)])
    with pytest.raises(ValueError) as caught:
        image_sources(row)
    message = str(caught.value)
    assert "has 3 image parts, 2 of them without an image, but its 'images' column holds 1" in message


def test_payloadless_part_without_an_images_column_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"has 1 image parts, 1 of them without an image, but its 'images' column "
        r"holds 0",
    ):
        image_sources(user_row({"type": "image"}))


def test_more_images_than_payloadless_parts_is_an_error():
    row = user_row({"type": "image"}, {"type": "image", "image": picture(0)}, images=[picture(1), picture(2)])
    with pytest.raises(ValueError) as caught:
        image_sources(row)
    assert "has 2 entries in its 'images' column but only 1 image parts without an image" in str(caught.value)


def test_images_column_without_any_image_part_is_an_error():
    row = {"messages": [{"role": "user", "content": "hi"}], "images": [picture(0)]}
    assert row_has_images(row)
    with pytest.raises(ValueError, match="has 1 entries in its 'images' column but only 0 image parts"):
        image_sources(row)


# ---- checks and errors ---------------------------------------------------------------------------------------------


def test_missing_file_names_its_path(tmp_path):
    missing = tmp_path / "gone" / "cat.png"
    for source in (str(missing), missing, f"file://{missing}", {"bytes": None, "path": str(missing)}):
        with pytest.raises(ValueError, match="does not exist") as caught:
            check_image_source(source)
        assert str(missing) in str(caught.value)
        with pytest.raises(ValueError, match="does not exist"):
            load_image(source)


def test_a_directory_is_not_an_image_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_image_source(str(tmp_path))


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://example.com/cat.png", "s3://bucket/cat.png"])
def test_remote_urls_are_refused(url):
    with pytest.raises(ValueError) as caught:
        check_image_source(url)
    message = str(caught.value)
    assert "is a URL" in message and url in message and "local file" in message
    with pytest.raises(ValueError, match="is a URL"):
        row_images(user_row({"type": "image", "url": url}))


@pytest.mark.parametrize("source", [123, None, ["a.png"], {"bytes": None, "path": None}, 1.5])
def test_unknown_payload_types_are_refused(source):
    with pytest.raises(ValueError, match="is not a PIL image, bytes"):
        check_image_source(source)


def test_row_has_images():
    assert not row_has_images({"messages": [{"role": "user", "content": "hi"}]})
    assert not row_has_images({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert not row_has_images({"messages": [{"role": "user", "content": "hi"}], "images": []})
    assert not row_has_images({"messages": [{"role": "user", "content": "hi"}], "images": None})
    assert row_has_images(user_row({"type": "image"}))
    assert row_has_images(user_row({"type": "image_url", "image_url": {"url": "x"}}))
    assert row_has_images({"messages": [{"role": "user", "content": "hi"}], "images": [picture(0)]})
    assert not row_has_images({})


def test_text_only_messages_join_text_parts_and_drop_images():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image", "image": picture(0)},
                {"type": "text", "text": "what"},
                {"type": "image_url", "image_url": {"url": "file:///x.png"}},
                {"type": "text", "text": " is it?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "square"}]},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": None, "name": "x"},
    ]
    out = text_only_messages(messages)
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look: what is it?"},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None, "name": "x"},
    ]
    assert isinstance(messages[1]["content"], list)  # the input is left as it was
