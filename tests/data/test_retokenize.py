"""Byte spans from token ids, the student's completions as text, and the teacher's batch of the same text, for the
project's byte tokenizer, a byte-level BPE and SentencePiece-style tokenizers. Expected spans are hand-checked
against the UTF-8 of each string: "café" = 63 61 66 C3 A9, "👍🏽" = F0 9F 91 8D F0 9F 8F BD,
"漢字" = E6 BC A2 E5 AD 97."""

import pytest
import torch

from lightning_gkd.data.chat import ChatMLCollator
from lightning_gkd.data.retokenize import (
    _BYTE_OF_CHAR,
    _TokenBytes,
    student_completions,
    teacher_batch,
    token_byte_spans,
)
from lightning_gkd.data.tokenizer import build_chatml_bpe_tokenizer, build_chatml_tokenizer
from lightning_gkd.ops.decoding.sampling import completion_batch
from tests.helpers.sentencepiece_style import sentencepiece_style_tokenizer

# The BPE's 18 merges (hand-read): caf, Ã©, cafÃ©, æ¼¢å, ŃĹ, Ġæ¼¢åŃĹ, ĊĊ, ĊĠ ("\n "), ĠĠ, Ġb, Ġy, ...
BPE_CORPUS = ["café café 漢字 漢字 a   b\n\n x\n  y"] * 4
TEXTS = ["café", "👍🏽", "漢字", "a   b\n\n"]
EMOJI_BYTES = ["ð", "Ł", "ĳ", "į", "ð", "Ł", "ı", "½"]  # byte-level characters of F0 9F 91 8D F0 9F 8F BD
EMOJI_FALLBACK = ["<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "<0xF0>", "<0x9F>", "<0x8F>", "<0xBD>"]
ONE_BYTE_EACH = [(k, k + 1) for k in range(8)]

# (tokens of the text alone, their spans); the EOS after them is zero-width at the content's end
EXPECTED = {
    "byte": {
        "café": (["c", "a", "f", "Ã", "©"], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        "👍🏽": (EMOJI_BYTES, ONE_BYTE_EACH),
        "漢字": (["æ", "¼", "¢", "å", "Ń", "Ĺ"], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]),
        "a   b\n\n": (["a", "Ġ", "Ġ", "Ġ", "b", "Ċ", "Ċ"], [(k, k + 1) for k in range(7)]),
    },
    "bpe": {
        "café": (["cafÃ©"], [(0, 5)]),
        "👍🏽": (EMOJI_BYTES, ONE_BYTE_EACH),
        "漢字": (["æ¼¢å", "ŃĹ"], [(0, 4), (4, 6)]),  # a merge that ends inside 字
        "a   b\n\n": (["a", "ĠĠ", "Ġb", "ĊĊ"], [(0, 1), (1, 3), (3, 5), (5, 7)]),
    },
    # both SentencePiece flavours: the prepended "▁" the decoder drops is zero-width
    "sentencepiece": {
        "café": (["▁caf", "é"], [(0, 3), (3, 5)]),
        "👍🏽": (["▁", *EMOJI_FALLBACK], [(0, 0), *ONE_BYTE_EACH]),
        "漢字": (["▁", "漢", "<0xE5>", "<0xAD>", "<0x97>"], [(0, 0), (0, 3), (3, 4), (4, 5), (5, 6)]),
        "a   b\n\n": (
            ["▁a", "▁", "▁", "▁b", "<0x0A>", "<0x0A>"],
            [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7)],
        ),
    },
}


@pytest.fixture(scope="module")
def tokenizers():
    return {
        "byte": build_chatml_tokenizer(),
        "bpe": build_chatml_bpe_tokenizer(BPE_CORPUS, merges=20),
        "metaspace": sentencepiece_style_tokenizer("metaspace"),
        "llama": sentencepiece_style_tokenizer("llama"),
    }


@pytest.fixture()
def no_incremental_decoding(monkeypatch):
    """The id-to-bytes mapping must hold for these tokenizers: the incremental fallback is not taken."""

    def refuse(self, ids):
        raise AssertionError(f"incremental decoding used for {ids}")

    monkeypatch.setattr(_TokenBytes, "_incremental", refuse)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("name", ["byte", "bpe", "metaspace", "llama"])
def test_spans_of_hand_checked_strings(tokenizers, name, text, no_incremental_decoding):
    tok = tokenizers[name]
    tokens, spans = EXPECTED["sentencepiece" if name in ("metaspace", "llama") else name][text]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == tokens
    end = len(text.encode())
    got, content = token_byte_spans(tok, [*ids, tok.eos_token_id, ids[0]], end_ids={tok.eos_token_id})
    assert got == [*spans, (end, end), (end, end)]  # the EOS and everything after it: zero-width at the end
    assert content == text.encode()


@pytest.mark.parametrize(
    ("name", "tokens", "spans"),
    [
        ("bpe", ["c", "a", "f", "Ã", "©"], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),  # not the merged "cafÃ©"
        ("bpe", ["caf", "Ã©"], [(0, 3), (3, 5)]),
        ("metaspace", ["▁", "c", "a", "f", "é"], [(0, 0), (0, 1), (1, 2), (2, 3), (3, 5)]),
        ("llama", ["c", "a", "f", "<0xC3>", "<0xA9>"], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_sampled_non_canonical_ids_get_exact_spans(tokenizers, name, tokens, spans, no_incremental_decoding):
    tok = tokenizers[name]
    ids = tok.convert_tokens_to_ids(tokens)
    assert ids != tok("café", add_special_tokens=False)["input_ids"]
    assert token_byte_spans(tok, ids, end_ids={tok.eos_token_id}) == (spans, "café".encode())


def test_added_tokens_in_the_content_span_their_text(tokenizers, no_incremental_decoding):
    tok = tokenizers["bpe"]
    ids = [*tok("a", add_special_tokens=False)["input_ids"], 1, tok.eos_token_id]  # a <|im_start|> <|im_end|>
    assert token_byte_spans(tok, ids, end_ids={2}) == ([(0, 1), (1, 13), (13, 13)], b"a<|im_start|>")


def test_ids_beyond_the_vocabulary_are_zero_width(tokenizers, no_incremental_decoding):
    """A model's embedding may have more rows than its tokenizer has tokens; decode skips such ids, and so do spans."""
    tok = tokenizers["byte"]
    assert token_byte_spans(tok, [70, 300, 71, 2], end_ids={2}) == ([(0, 1), (1, 1), (1, 2), (2, 2)], b"de")


def test_incremental_decoding_for_other_decoders():
    """A decoder that is neither byte-level nor metaspace: each token gets what it adds to the decoded text, and a
    character split across byte tokens belongs to the token that completes it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{byte:02X}>": 2 + byte for byte in range(256)}, "c": 258, "af": 259}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    ids = tok.convert_tokens_to_ids(["c", "af", "<0xC3>", "<0xA9>", "</s>"])
    assert token_byte_spans(tok, ids, end_ids={1}) == ([(0, 1), (1, 3), (3, 3), (3, 5), (5, 5)], "café".encode())


def test_student_completions_of_a_dataset_batch(tokenizers, no_incremental_decoding):
    tok = tokenizers["byte"]
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]} for text in TEXTS]
    batch = ChatMLCollator(tok, 64)(rows)
    completions = student_completions(tok, batch)
    for completion, text, row_labels in zip(completions, TEXTS, batch["labels"], strict=True):
        end = len(text.encode())
        assert completion.text == text
        assert completion.ids == [*tok(text, add_special_tokens=False)["input_ids"], 2, 201]  # <|im_end|> "\n"
        assert completion.positions == (row_labels != -100).nonzero().flatten().tolist()
        assert completion.spans == [*EXPECTED["byte"][text][1], (end, end), (end, end)]


def test_student_completions_of_samples_with_invalid_utf8():
    """A byte-level sample may hold bytes that make no character: the text gets one U+FFFD per invalid sequence and
    the spans move into that text's bytes, so a teacher tokenizing the text ends at the same byte."""
    tok = build_chatml_tokenizer()
    prompts = torch.tensor([[0, 1, 70]])
    # "a", C3 (a lead byte without its continuation), "(", F0 9F (a 4-byte lead cut short), EOS, then padding
    byte_ids = [ord("a"), 0xC3, ord("("), 0xF0, 0x9F]
    char_of_byte = {byte: char for char, byte in _BYTE_OF_CHAR.items()}
    sample = tok.convert_tokens_to_ids([char_of_byte[byte] for byte in byte_ids])
    batch = completion_batch(prompts, torch.tensor([[0, 1, 1]]), torch.tensor([[*sample, 2, 0]]), 2)
    (completion,) = student_completions(tok, batch)
    assert completion.text == "a\ufffd(\ufffd"  # 1 + 3 + 1 + 3 = 8 bytes
    assert completion.ids == [*sample, 2]
    assert completion.positions == [3, 4, 5, 6, 7, 8]
    assert completion.spans == [(0, 1), (1, 4), (4, 5), (5, 8), (8, 8), (8, 8)]
    teacher = teacher_batch(
        build_chatml_bpe_tokenizer(BPE_CORPUS, merges=20),
        [[{"role": "user", "content": "q"}]],
        [completion.text],
        max_length=64,
    )
    # the teacher reads U+FFFD as its 3 bytes EF BF BD: its spans end at 1, 4, 5 and 8 too (and at 2, 3, 6, 7)
    assert teacher["completion_spans"] == [[(k, k + 1) for k in range(8)] + [(8, 8)]]


@pytest.mark.parametrize("name", ["metaspace", "llama"])
def test_invalid_byte_fallback_samples_keep_the_mapping(tokenizers, name, no_incremental_decoding):
    """SentencePiece's decoder writes one U+FFFD per invalid byte, Python one per invalid sequence: the spans still
    come from the ids, and the text has one U+FFFD per invalid sequence."""
    tok = tokenizers[name]
    ids = [*tok.convert_tokens_to_ids(["▁a", "<0xC3>", "▁b", "<0xF0>", "<0x9F>"]), 2]
    assert token_byte_spans(tok, ids, end_ids={2}) == (
        [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6), (6, 6)],
        b"a\xc3 b\xf0\x9f",
    )
    (completion,) = student_completions(tok, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])})
    assert completion.text == "a\ufffd b\ufffd"  # 1 + 3 + 2 + 3 = 9 bytes
    assert completion.spans == [(0, 1), (1, 4), (4, 6), (6, 9), (9, 9), (9, 9)]


def test_student_completions_refuse_several_labelled_turns(tokenizers):
    tok = tokenizers["byte"]
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    batch = ChatMLCollator(tok, 64, assistant_turns="all")([row])
    with pytest.raises(ValueError, match=r"Row 0 .* not one run .*data\.assistant_turns=last"):
        student_completions(tok, batch)


def test_teacher_batch_is_the_teachers_template_then_the_content_then_its_eos(tokenizers):
    tok = tokenizers["bpe"]
    prompts = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
    ]
    out = teacher_batch(tok, prompts, ["café", "a   b\n\n"], max_length=64)
    assert [tok.convert_ids_to_tokens(ids) for ids in out["completion_ids"]] == [
        ["cafÃ©", "<|im_end|>"],
        ["a", "ĠĠ", "Ġb", "ĊĊ", "<|im_end|>"],
    ]
    assert out["completion_spans"] == [[(0, 5), (5, 5)], [(0, 1), (1, 3), (3, 5), (5, 7), (7, 7)]]
    for row, (messages, completion) in enumerate(zip(prompts, out["completion_ids"], strict=True)):
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(rendered, add_special_tokens=False)["input_ids"]
        mask = out["attention_mask"][row].bool()
        assert out["input_ids"][row][mask].tolist() == [*prompt, *completion]
        assert out["labels"][row][mask].tolist() == [-100] * len(prompt) + completion
        assert not mask[-1:].logical_not().any()  # left-padded: every row ends at the last column
    assert out["attention_mask"][0, 0].item() == 0 and out["input_ids"][0, 0].item() == tok.pad_token_id


@pytest.mark.parametrize("name", ["metaspace", "llama"])
def test_teacher_batch_with_a_sentencepiece_teacher(tokenizers, name, no_incremental_decoding):
    """Byte-fallback tokens get exact spans right after the template, and a content's leading space is its own."""
    tok = tokenizers[name]
    out = teacher_batch(tok, [[{"role": "user", "content": "hi"}]] * 3, ["👍🏽", "漢字", " y"], max_length=64)
    assert [tok.convert_ids_to_tokens(ids) for ids in out["completion_ids"]] == [
        [*EMOJI_FALLBACK, "</s>"],
        ["漢", "<0xE5>", "<0xAD>", "<0x97>", "</s>"],
        ["▁y", "</s>"],
    ]
    assert out["completion_spans"] == [
        [*ONE_BYTE_EACH, (8, 8)],
        [(0, 3), (3, 4), (4, 5), (5, 6), (6, 6)],
        [(0, 2), (2, 2)],
    ]


def test_a_token_merged_across_the_prompt_boundary_stays_in_the_prompt(tokenizers):
    """The template ends in "\\n" and the content starts with two spaces: the BPE merges "\\n " into one token
    (ĊĠ), which stays in the prompt; the content's first byte then has no teacher token."""
    tok = tokenizers["bpe"]
    out = teacher_batch(tok, [[{"role": "user", "content": "hi"}]], ["  y"], max_length=64)
    mask = out["attention_mask"][0].bool()
    tokens = tok.convert_ids_to_tokens(out["input_ids"][0][mask].tolist())
    assert tokens[-3:] == ["ĊĠ", "Ġy", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(out["completion_ids"][0]) == ["Ġy", "<|im_end|>"]
    assert out["completion_spans"] == [[(1, 3), (3, 3)]]


@pytest.mark.parametrize("text", [*TEXTS, "  y"])
@pytest.mark.parametrize("student_name", ["byte", "bpe", "metaspace"])
@pytest.mark.parametrize("teacher_name", ["byte", "bpe", "llama"])
def test_student_and_teacher_spans_of_the_same_text_end_at_the_same_byte(tokenizers, student_name, teacher_name, text):
    student, teacher = tokenizers[student_name], tokenizers[teacher_name]
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]}
    (completion,) = student_completions(student, ChatMLCollator(student, 64, carry_prompt_messages=True)([row]))
    out = teacher_batch(teacher, [row["messages"][:1]], [completion.text], max_length=64)
    content_len = len(completion.text.encode())
    student_ends = [end for _, end in completion.spans]
    teacher_ends = [end for _, end in out["completion_spans"][0]]
    assert student_ends[-1] == teacher_ends[-1] == content_len
    assert student_ends == sorted(student_ends) and teacher_ends == sorted(teacher_ends)
    # contiguous: each span starts where the previous one ended (the first at 0, or past a merged boundary byte)
    for spans in (completion.spans, out["completion_spans"][0]):
        assert all(start == end for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


def test_teacher_batch_truncates_the_prompt_and_refuses_a_completion_that_does_not_fit(tokenizers):
    tok = tokenizers["byte"]
    prompts = [[{"role": "user", "content": "a long question"}]]
    whole = teacher_batch(tok, prompts, ["42"], max_length=256)
    cut = teacher_batch(tok, prompts, ["42"], max_length=10)
    assert cut["input_ids"].shape == (1, 10)
    assert cut["input_ids"][0].tolist() == whole["input_ids"][0, -10:].tolist()
    assert cut["labels"][0].tolist() == [-100] * 7 + tok.convert_tokens_to_ids(["4", "2"]) + [2]
    with pytest.raises(ValueError, match=r"Row 0: the teacher's tokens of the completion \(3, EOS included\) do "):
        teacher_batch(tok, prompts, ["42"], max_length=3)


def test_teacher_batch_refuses_a_tokenizer_that_changes_the_text(tokenizers):
    from tokenizers import normalizers

    tok = build_chatml_bpe_tokenizer(BPE_CORPUS, merges=20)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(
        ValueError, match=r"Row 0: the teacher's tokens of the text end with 'cafe', not the content's 'CAFE'"
    ):
        teacher_batch(tok, [[{"role": "user", "content": "hi"}]], ["CAFE"], max_length=64)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        teacher_batch(tok, [[{"role": "user", "content": "hi"}]], ["x"], max_length=64)
