"""Tokenizers: load one from a folder or hub id, or build the project's own offline byte-level ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Tokenizer classes that mean "the tokenizer.json in this folder, as saved": load these with the generic fast
# class, because AutoTokenizer may otherwise build the tokenizer of the model family named in config.json.
_GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def build_chatml_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges (one token per byte) plus ChatML special tokens.

    Ids: 0 ``<|endoftext|>`` (pad), 1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS, ends every turn), then the 256
    byte symbols in sorted order (259 tokens). Offsets are monotonic, so offset-based collators (ours, TRL's)
    accept it. Deterministic: it needs no training corpus.
    """
    specials = [PAD_TOKEN, IM_START, IM_END]
    vocab = {token: index for index, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(
    name_or_path: str | Path, *, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder or a hub id.

    A folder whose ``tokenizer_config.json`` names a generic fast tokenizer (what ``build_chatml_tokenizer`` saves)
    is loaded with that class, so token ids survive save -> load even next to a model ``config.json``.
    """
    folder = Path(name_or_path)
    if folder.is_dir():
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
            if tokenizer_class in _GENERIC_TOKENIZER_CLASSES:
                return PreTrainedTokenizerFast.from_pretrained(str(folder))
    elif str(name_or_path).startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"Tokenizer folder {str(name_or_path)!r} does not exist. "
            "Pass an existing folder written by save_pretrained, or a hub id."
        )
    return AutoTokenizer.from_pretrained(str(name_or_path), revision=revision, trust_remote_code=trust_remote_code)
