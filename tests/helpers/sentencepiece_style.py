"""SentencePiece-style tokenizers built offline with ``tokenizers``: a Unigram model over a small hand-written
vocabulary with byte fallback (``<0xNN>`` tokens), ``▁`` for spaces, and a tiny chat template. Two flavours of the
same model: ``"metaspace"`` (Metaspace pre-tokenizer and decoder, as T5/Gemma-style tokenizers) and ``"llama"``
(Llama 2's normalizer prepending ``▁`` and replacing spaces, and its Replace/ByteFallback/Fuse/Strip decoder)."""

from __future__ import annotations

from typing import Literal

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]  # ids 3..258
PIECES = ["▁", "▁a", "▁b", "▁caf", "é", "a", "b", "c", "f", "漢", "▁y", "user", "assistant", "hi"]  # ids 259..
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def sentencepiece_style_tokenizer(flavour: Literal["metaspace", "llama"] = "metaspace") -> PreTrainedTokenizerFast:
    """Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (EOS), 3..258 the byte tokens ``<0x00>``..``<0xFF>``, then ``PIECES``
    (single characters score -4, longer pieces -2, so a known piece wins over its characters)."""
    scores = [(token, 0.0) for token in SPECIALS] + [(token, -20.0) for token in BYTE_TOKENS]
    scores += [(piece, -4.0 if len(piece) == 1 else -2.0) for piece in PIECES]
    backend = Tokenizer(models.Unigram(scores, unk_id=0, byte_fallback=True))
    if flavour == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer
