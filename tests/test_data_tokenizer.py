import json

from transformers import AutoTokenizer, Qwen2Config

from lightning_gkd.data.tokenizer import CHATML_TEMPLATE, build_chatml_tokenizer, load_tokenizer

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
