import json

import pytest
from transformers import AutoTokenizer, Qwen2Config

from lightning_gkd.data.tokenizer import (
    CHATML_TEMPLATE,
    build_chatml_bpe_tokenizer,
    build_chatml_tokenizer,
    load_tokenizer,
)

TEXT = "<|im_start|>user\nWhat is 12 + 30?\tNo tabs lost, no  double spaces, é ü 🙂<|im_end|>\n"


def test_special_ids_and_byte_level_round_trip():
    tok = build_chatml_tokenizer()
    assert len(tok) == 259
    assert (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id) == (0, 1, 2)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert ids[0] == 1 and ids[-2:] == [2, 201]  # <|im_start|> ... <|im_end|> "\n"
    assert tok(" ", add_special_tokens=False)["input_ids"] == [223]


def test_ids_survive_save_and_load_next_to_a_model_config(tmp_path):
    """transformers 5 may build the model family's tokenizer from config.json; ids must not change."""
    tok = build_chatml_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    expected = tok(TEXT, add_special_tokens=False)["input_ids"]
    for loaded in (load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert loaded(TEXT, add_special_tokens=False)["input_ids"] == expected
        assert loaded.decode(expected) == TEXT
        assert loaded.chat_template == CHATML_TEMPLATE
        assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 2)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    )


def test_offsets_are_monotonic():
    tok = build_chatml_tokenizer()
    offsets = tok(TEXT, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    starts = [start for start, _ in offsets]
    assert starts == sorted(starts) and offsets[-1][1] == len(TEXT)


BPE_CORPUS = [
    f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n{a + b} is the answer<|im_end|>\n"
    for a in range(100, 160)
    for b in (7, 58, 230)
]


def test_bpe_tokenizer_is_deterministic_and_merges_the_corpus():
    tok = build_chatml_bpe_tokenizer(BPE_CORPUS, merges=40)
    again = build_chatml_bpe_tokenizer(BPE_CORPUS, merges=40)
    assert tok.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()
    assert len(tok) == 259 + 40
    assert (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id) == (0, 1, 2)
    byte_tok = build_chatml_tokenizer()
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in byte_tok.get_vocab().items())  # bytes keep their ids
    tokens = tok.convert_ids_to_tokens(tok("assistant\n230 is the answer", add_special_tokens=False)["input_ids"])
    assert tokens == ["assistant", "Ċ", "230", "Ġis", "Ġthe", "Ġanswer"]  # corpus words and digit runs merged
    specials = sorted(t for t in tok.get_vocab() if "<|" in t or "|>" in t)
    assert specials == ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # no merge spans a special token
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT and len(ids) < len(byte_tok(TEXT, add_special_tokens=False)["input_ids"])
    assert ids[0] == 1 and ids[-2:] == [2, 201]
    offsets = tok(TEXT, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    starts = [start for start, _ in offsets]
    assert starts == sorted(starts) and offsets[-1][1] == len(TEXT)


def test_bpe_tokenizer_renders_chat_like_the_byte_tokenizer():
    tok = build_chatml_bpe_tokenizer(BPE_CORPUS, merges=40)
    messages = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == build_chatml_tokenizer().apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    assert tok.chat_template == CHATML_TEMPLATE


def test_bpe_ids_survive_save_and_load_next_to_a_model_config(tmp_path):
    """AutoTokenizer next to a Qwen2 config.json builds Qwen2's tokenizer (digits split one by one, design.md §4),
    so a folder holding a model must be read with load_tokenizer; a bare tokenizer folder loads either way."""
    tok = build_chatml_bpe_tokenizer(BPE_CORPUS, merges=40)
    text = TEXT + " 123 answer"
    expected = tok(text, add_special_tokens=False)["input_ids"]
    assert max(expected) >= 259  # merged tokens are in the text
    bare, with_model = tmp_path / "bare", tmp_path / "with_model"
    tok.save_pretrained(bare)
    tok.save_pretrained(with_model)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(with_model)
    for loaded in (load_tokenizer(with_model), load_tokenizer(bare), AutoTokenizer.from_pretrained(bare)):
        assert loaded(text, add_special_tokens=False)["input_ids"] == expected
        assert loaded.decode(expected) == text
        assert loaded.chat_template == CHATML_TEMPLATE
        assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 2, len(tok))


def test_bpe_merges_must_not_be_negative():
    with pytest.raises(ValueError, match="merges must be >= 0"):
        build_chatml_bpe_tokenizer(BPE_CORPUS, merges=-1)
