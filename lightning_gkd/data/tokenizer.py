"""Tokenizers: load one from a folder or hub id, or build the project's own offline ChatML tokenizers (one token
per byte, or a byte-level BPE trained on a corpus)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: ``CHATML_TEMPLATE`` that also renders tools: a first system turn naming them (``tools: lookup, add``); tool
#: messages are turns of role ``tool``. Compact on purpose: the toy models have short contexts.
TOOLS_CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools: ' }}{% for tool in tools %}"
    "{{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}" + CHATML_TEMPLATE
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
    return _chatml_fast(backend)


def build_chatml_bpe_tokenizer(corpus: Iterable[str], *, merges: int = 200) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) whose merges are learned on ``corpus``, plus ChatML special tokens.

    Ids: 0 ``<|endoftext|>`` (pad), 1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS), then the 256 byte symbols in sorted
    order (the same ids as ``build_chatml_tokenizer``'s), then at most ``merges`` merged tokens, most frequent first
    (fewer when the corpus has fewer pairs seen at least twice). The text is split GPT-2's way (words, digit runs,
    whitespace) before merging, and special tokens in the corpus are cut out of it, so no merge spans them.
    Deterministic: the same corpus and ``merges`` give the same vocabulary and merges. Every byte has a token, so any
    text encodes; offsets are monotonic; the chat template is ``CHATML_TEMPLATE``.
    """
    if merges < 0:
        raise ValueError(f"merges must be >= 0 (the number of BPE merges to learn), got {merges}.")
    specials = [PAD_TOKEN, IM_START, IM_END]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    split = re.compile("|".join(re.escape(token) for token in specials))
    pieces = [piece for text in corpus for piece in split.split(text) if piece]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet) + merges,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=alphabet,
    )
    backend.train_from_iterator(pieces, trainer=trainer)
    return _chatml_fast(backend)


def _chatml_fast(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """``backend`` (a byte-level model and pre-tokenizer) with the byte-level decoder, the ChatML special tokens,
    EOS ``<|im_end|>``, pad ``<|endoftext|>`` and ``CHATML_TEMPLATE``."""
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD_TOKEN, IM_START, IM_END])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable hash (hex blake2b-128) of the vocabulary (token -> id, added tokens included), the special tokens and
    the chat template: what turns a conversation into ids (a teacher cache's key, ``teachers.offline``; the projection
    tables' cache, ``data.token_projection``). The pad token is left out: padding never reaches the cache, and
    ``ChatDataModule`` sets a missing one to EOS."""
    special = {name: value for name, value in tokenizer.special_tokens_map.items() if name != "pad_token"}
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    hasher = hashlib.blake2b(digest_size=16)
    for part in (vocab, special, getattr(tokenizer, "chat_template", None)):
        hasher.update(json.dumps(part, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode())
    return hasher.hexdigest()


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
