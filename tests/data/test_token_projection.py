"""data/token_projection.py: each teacher token's first student token, its bytes, and the teacher tokens extending each
prefix, on a byte-level BPE and a SentencePiece-style teacher against the byte-level student."""

import pytest
import torch

from lightning_gkd.data.token_projection import projection_tables
from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer, build_chatml_tokenizer
from tests.helpers.sentencepiece_style import sentencepiece_style_tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return {
        "byte": build_chatml_tokenizer(),
        "bpe": build_chatml_bpe_tokenizer(["café café 漢字 漢字 a   b\n\n x\n  y"] * 4, merges=20),
        "metaspace": sentencepiece_style_tokenizer("metaspace"),
    }


def test_first_token_sends_each_teacher_token_to_the_student_token_its_text_starts_with(tokenizers):
    student, bpe, metaspace = tokenizers["byte"], tokenizers["bpe"], tokenizers["metaspace"]

    def mapped(teacher, token: str) -> str | None:
        target = int(projection_tables(student, teacher).first_token[teacher.convert_tokens_to_ids(token)])
        return None if target < 0 else student.convert_ids_to_tokens(target)

    # byte-level BPE teacher: a merge goes to its first byte; specials by their string
    assert mapped(bpe, "cafÃ©") == "c" and mapped(bpe, "ĠĠ") == "Ġ" and mapped(bpe, "a") == "a"
    assert mapped(bpe, "<|im_end|>") == "<|im_end|>" and mapped(bpe, "<|im_start|>") == "<|im_start|>"
    assert mapped(bpe, "æ¼¢å") is None  # E6 BC A2 E5: 漢 and the first byte of 字, not whole characters
    # SentencePiece teacher: "▁" is a space, byte tokens their byte; its EOS "</s>" is not a student token: the
    # student's EOS
    assert mapped(metaspace, "▁caf") == "Ġ" and mapped(metaspace, "<0x0A>") == "Ċ" and mapped(metaspace, "é") == "Ã"
    assert mapped(metaspace, "</s>") == "<|im_end|>"
    assert mapped(metaspace, "<0xE5>") is None
    # the same tokenizer on both sides: the identity on every token with whole characters
    identity = projection_tables(student, student).first_token
    ascii_ids = student("hello world\n", add_special_tokens=False)["input_ids"]
    assert identity[ascii_ids].tolist() == ascii_ids
    assert identity.numel() == len(student)


def test_projection_tables_list_the_teacher_tokens_that_extend_each_prefix(tokenizers):
    student, bpe = tokenizers["byte"], tokenizers["bpe"]
    tables = projection_tables(student, bpe)
    cafe = bpe.convert_tokens_to_ids("cafÃ©")
    assert tables.token_bytes(cafe) == "café".encode() and tables.token_bytes(bpe.eos_token_id) is None
    ids, targets = tables.extending(b"caf")  # "café" goes on with "é": the student's first byte of it is "Ã"
    assert cafe in ids.tolist()
    assert student.convert_ids_to_tokens(int(targets[ids.tolist().index(cafe)])) == "Ã"
    # "æ¼¢å" is 漢 and the first byte of 字: after the prefix 漢 its remainder is no whole character, so it is left out
    kan = bpe.convert_tokens_to_ids("æ¼¢å")
    assert tables.token_bytes(kan) == "漢".encode() + b"\xe5"
    assert kan not in (tables.extending("漢".encode()) or (torch.tensor([]), None))[0].tolist()


def test_projection_tables_cache_hits_for_the_same_pair_and_misses_when_a_tokenizer_changes(tokenizers, tmp_path):
    from dataclasses import fields

    from lightning_gkd.data.token_projection import projection_cache_path
    from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer

    student, bpe = tokenizers["byte"], tokenizers["bpe"]
    built = projection_tables(student, bpe, cache_dir=tmp_path)
    path = projection_cache_path(student, bpe, tmp_path)
    assert path.is_file() and list(tmp_path.iterdir()) == [path]
    marker = torch.load(path, weights_only=True)
    marker["first_token"] = torch.full_like(marker["first_token"], 7)  # a hit reads the file, not a rebuild
    torch.save(marker, path)
    hit = projection_tables(student, bpe, cache_dir=tmp_path)
    assert hit.first_token.tolist() == [7] * len(bpe)
    for field in fields(built):
        if field.name != "first_token":
            assert torch.equal(getattr(hit, field.name), getattr(built, field.name))
    # another teacher (fewer merges), or the pair the other way round: another file, built afresh
    other = build_chatml_bpe_tokenizer(["café café 漢字 漢字 a   b\n\n x\n  y"] * 4, merges=5)
    assert other.get_vocab() != bpe.get_vocab()
    assert projection_cache_path(student, other, tmp_path) != path
    assert projection_cache_path(bpe, student, tmp_path) != path
    fresh = projection_tables(student, other, cache_dir=tmp_path)
    assert torch.equal(fresh.first_token, projection_tables(student, other).first_token)
    assert len(list(tmp_path.iterdir())) == 2
    # a changed chat template changes the fingerprint too
    templated = build_chatml_bpe_tokenizer(["café café 漢字 漢字 a   b\n\n x\n  y"] * 4, merges=20)
    templated.chat_template = "{{ messages[0]['content'] }}"
    assert projection_cache_path(student, templated, tmp_path) != path
