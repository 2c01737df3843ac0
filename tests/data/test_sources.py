"""load_rows on local files: every supported type loads; an empty, unreadable or unsupported file is an error naming
it and what it must hold (issue 16 item 9)."""

import json

import datasets
import pytest

from lightning_gkd.data.sources import load_rows

ROW = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}


def test_arrow_files_and_save_to_disk_folders_load(tmp_path):
    datasets.Dataset.from_list([ROW, ROW]).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "saved", arrow):
        rows = load_rows(str(source))
        assert len(rows) == 2 and rows[1] == ROW


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_csv_reads_every_column_as_text_and_only_empty_cells_as_null(tmp_path, suffix, sep):
    path = tmp_path / f"rows{suffix}"
    path.write_text(f"prompt{sep}completion\n1+2={sep}3\nNA{sep}\n")
    rows = load_rows(str(path))
    assert [dict(row) for row in rows] == [{"prompt": "1+2=", "completion": "3"}, {"prompt": "NA", "completion": None}]


@pytest.mark.parametrize(
    "name, content, holds",
    [
        ("rows.jsonl", "", "JSON Lines: one JSON object per line"),
        ("rows.jsonl", "\n\n", "JSON Lines: one JSON object per line"),
        ("rows.json", "", "a JSON list of objects"),
        ("rows.json", "[]", "a JSON list of objects"),
        ("rows.parquet", "", "a Parquet table"),
        ("rows.csv", "prompt,completion\n", "a header line then rows of text columns"),
    ],
)
def test_an_empty_file_is_named(tmp_path, name, content, holds):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as caught:
        load_rows(str(path), name="val_data")
    assert str(caught.value).startswith(
        f"val_data: data file '{path}' is empty: it has no rows. Write at least one row into it; a "
        f"{path.suffix} file holds {holds}"
    )


def test_an_empty_parquet_table_is_named(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([ROW]).select([]).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"^train_data: data file '.*rows\.parquet' is empty: it has no rows"):
        load_rows(str(path))


def test_an_unreadable_file_is_named_with_the_parsers_words(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + '{"messages": [\n')
    with pytest.raises(ValueError) as caught:
        load_rows(str(path))
    message = str(caught.value)
    assert message.startswith(f"train_data: cannot read data file '{path}' as .jsonl (")
    assert message.endswith(
        'A .jsonl file holds JSON Lines: one JSON object per line, e.g. {"messages": [...]}; fix the file or '
        "convert it to one of .jsonl, .json, .parquet, .arrow, .csv, .tsv."
    )


def test_an_existing_file_of_another_type_says_which_are_supported(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("1+2=3\n")
    with pytest.raises(
        ValueError,
        match=r"^train_data: '.*rows\.txt' is a \.txt file, which is not a supported data file\. Supported: "
        r"\.jsonl, \.json, \.parquet, \.arrow, \.csv, \.tsv \(or a dataset folder\)\. Convert it",
    ):
        load_rows(str(path))
    with pytest.raises(FileNotFoundError, match=r"'.*gone\.csv' does not exist"):
        load_rows(str(tmp_path / "gone.csv"))
