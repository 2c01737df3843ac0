"""Cross-tokenizer data: the UTF-8 byte span of every completion token (computed from the token ids themselves), the
student's completions as text with spans, and the teacher's batch of the same text in its own tokenization.

Byte spans are relative to the start of the completion's *content* (the completion before its first end token); end
tokens (the first EOS and everything after it) are zero-width at the content's end, so the student's and the
teacher's spans of the same text end at the same byte, which is what ``ops.cross_tokenizer.align_byte_spans`` needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from lightning_gkd.data.chat_tokens import left_pad, render_chat
from lightning_gkd.ops.constants import IGNORE_INDEX

Span = tuple[int, int]
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()


def _decoder_kind(tokenizer: PreTrainedTokenizerBase) -> Literal["byte_level", "metaspace"] | None:
    """How a fast tokenizer's tokens map to bytes, from its decoder: GPT-2 byte-level, SentencePiece's metaspace
    (``▁`` for a space, ``<0xNN>`` byte-fallback tokens), or neither (None: decode incrementally)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    stack, kinds = [json.loads(decoder.__getstate__())], set()
    while stack:
        node = stack.pop()
        stack.extend(node.get("decoders") or [])
        if node.get("type") == "ByteLevel":
            kinds.add("byte_level")
        is_metaspace_replace = node.get("type") == "Replace" and node.get("pattern", {}).get("String") == _METASPACE
        if node.get("type") == "Metaspace" or is_metaspace_replace:
            kinds.add("metaspace")
    if kinds == {"byte_level"}:
        return "byte_level"
    return "metaspace" if kinds == {"metaspace"} else None


class _TokenBytes:
    """The bytes of each token of one tokenizer (built once per batch: the decoder kind and the added tokens)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self.added = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}

    def content_pieces(self, ids: list[int]) -> list[bytes]:
        """Each id's bytes, their concatenation equal to the UTF-8 of ``decode(ids)`` (invalid UTF-8 aside)."""
        text = self.text(ids)
        pieces = self._mapped(ids)
        if pieces is not None and not _same_text(pieces, text) and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]  # SentencePiece decoders drop the space the first token starts with
        if pieces is None or not _same_text(pieces, text):
            pieces = self._incremental(ids)
        return pieces

    def _mapped(self, ids: list[int]) -> list[bytes] | None:
        if self.kind is None:
            return None
        pieces = []
        for index, token in zip(ids, self.tokenizer.convert_ids_to_tokens(ids), strict=True):
            if token is None:  # beyond the tokenizer's vocabulary (a model's padded rows): decode skips it
                pieces.append(b"")
            elif index in self.added:
                pieces.append(self.added[index].encode())
            elif self.kind == "byte_level":
                if any(char not in _BYTE_OF_CHAR for char in token):
                    return None
                pieces.append(bytes(_BYTE_OF_CHAR[char] for char in token))
            elif byte := _BYTE_TOKEN.fullmatch(token):
                pieces.append(bytes([int(byte.group(1), 16)]))
            else:
                pieces.append(token.replace(_METASPACE, " ").encode())
        return pieces

    def _incremental(self, ids: list[int]) -> list[bytes]:
        """Token k's bytes: where ``decode(ids[:k + 1])`` stops agreeing with the decode of all ids, past the end of
        token k - 1's (a character split across tokens goes to the token that completes it)."""
        whole = self._decode(ids)
        pieces, end = [], 0
        for k in range(len(ids)):
            prefix = self._decode(ids[: k + 1])
            agree = next((i for i, (a, b) in enumerate(zip(prefix, whole, strict=False)) if a != b), None)
            new_end = max(end, min(len(prefix), len(whole)) if agree is None else agree)
            pieces.append(whole[end:new_end])
            end = new_end
        if pieces:
            pieces[-1] += whole[end:]
        return pieces

    def _decode(self, ids: list[int]) -> bytes:
        return self.text(ids).encode()

    def text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, not text.")
        return text


def _lossy(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _same_text(pieces: Sequence[bytes], text: str) -> bool:
    """Whether the pieces are the decoded ``text``; invalid UTF-8 aside (decoders differ in how many U+FFFD they
    write for it: one per byte for SentencePiece's byte fallback, one per invalid sequence for byte-level)."""
    joined = _lossy(b"".join(pieces))
    return joined == text or ("\ufffd" in joined and joined.replace("\ufffd", "") == text.replace("\ufffd", ""))


def _spans(pieces: Sequence[bytes], num_ids: int) -> tuple[list[Span], bytes]:
    spans, end = [], 0
    for piece in pieces:
        spans.append((end, end + len(piece)))
        end += len(piece)
    return spans + [(end, end)] * (num_ids - len(pieces)), b"".join(pieces)


def _content_length(ids: Sequence[int], end_ids: Collection[int]) -> int:
    return next((k for k, index in enumerate(ids) if index in end_ids), len(ids))


def token_byte_spans(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, end_ids: Collection[int]
) -> tuple[list[Span], bytes]:
    """The UTF-8 byte span ``(start, end)`` of each id, relative to the content's start, and the content's bytes.

    The content is ``ids`` before the first id in ``end_ids``; that id and every id after it are zero-width at
    ``(len(content), len(content))``. Spans come from the ids themselves, never from re-tokenizing text, so a
    sampled sequence that is not the tokenizer's own tokenization of its text still gets exact spans:

    * byte-level BPE (a ``ByteLevel`` decoder: GPT-2, Qwen, Llama 3, the project's ChatML tokenizers): each token's
      characters mapped back to bytes through the byte-level alphabet;
    * SentencePiece style (a ``Metaspace`` decoder, or ``▁`` replaced by a space: Llama 2, Mistral, Gemma): ``▁`` is a
      space and ``<0xNN>`` byte-fallback tokens are that byte; the space a first token starts with is dropped,
      as the decoder drops it (the first token ``▁Hi`` spans the 2 bytes of ``Hi``);
    * any other tokenizer (and a check failure above): incremental decoding, token k's bytes are where
      ``decode(ids[:k + 1])`` extends ``decode(ids[:k])``; a character split across tokens then belongs to the
      token that completes it, and invalid UTF-8 counts as the decoder's replacement characters.

    Added tokens (special or not, e.g. ``<|im_start|>``) before the first end id span the bytes of their text, as
    ``decode`` renders them: the content is the text ``decode(content ids)`` shows, and a teacher reads that text.
    Ids beyond the tokenizer's vocabulary (a model's padded embedding rows) are zero-width, as ``decode`` skips them.
    The content's bytes may be invalid UTF-8 (a byte-level sample can stop inside a character): ``student_completions``
    turns them into text.
    """
    ids = [int(index) for index in ids]
    content = ids[: _content_length(ids, end_ids)]
    return _spans(_TokenBytes(tokenizer).content_pieces(content) if content else [], len(ids))


@dataclass(frozen=True)
class Completion:
    """One row's completion: ``ids`` (its supervised tokens, ``labels != -100``, in order) at ``positions`` (their
    columns in the batch row), each token's byte span in ``text.encode()`` (end tokens zero-width at its end), and
    ``text``: the content (before the first end token) as text."""

    ids: list[int]
    positions: list[int]
    spans: list[Span]
    text: str


def student_completions(
    tokenizer: PreTrainedTokenizerBase, batch: Mapping[str, Any], *, end_ids: Collection[int] | None = None
) -> list[Completion]:
    """The completions of a student batch (``labels`` ``(B, L)``: dataset completions or samples), one per row.

    ``end_ids``: the ids that end a completion (default: the tokenizer's EOS). The content's bytes
    (``token_byte_spans``) become text with ``errors="replace"``: each invalid UTF-8 sequence (a sample stopped
    inside a character, or bytes that make no character) is one U+FFFD, and spans are moved into that text's bytes
    (a span ending inside the sequence ends after its U+FFFD), so they end where the teacher's spans of the same
    text end.
    A row whose supervised tokens are not one run (``assistant_turns="all"`` labels earlier turns) is a
    ``ValueError``: only the last assistant turn has a teacher-side text.
    """
    if end_ids is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("The student's tokenizer has no EOS token; pass end_ids (the ids ending a completion).")
        end_ids = {tokenizer.eos_token_id}
    token_bytes = _TokenBytes(tokenizer)
    completions = []
    for row, (labels, input_ids) in enumerate(zip(batch["labels"].tolist(), batch["input_ids"].tolist(), strict=True)):
        positions = [column for column, label in enumerate(labels) if label != IGNORE_INDEX]
        if positions and positions[-1] - positions[0] + 1 != len(positions):
            raise ValueError(
                f"Row {row} of the batch is supervised at {len(positions)} columns that are not one run (columns "
                f"{positions[0]}..{positions[-1]}): several assistant turns are labelled (assistant_turns='all'). "
                "Cross-tokenizer distillation trains on the last assistant turn only; use assistant_turns='last' "
                "(Hydra: data.assistant_turns=last)."
            )
        ids = [input_ids[column] for column in positions]
        content = ids[: _content_length(ids, end_ids)]
        spans, raw = _spans(token_bytes.content_pieces(content) if content else [], len(ids))
        text, moved = _replaced(raw)
        completions.append(Completion(ids, positions, [(moved[s], moved[e]) for s, e in spans], text))
    return completions


def _replaced(raw: bytes) -> tuple[str, list[int]]:
    """``raw.decode("utf-8", errors="replace")`` and, for each byte offset 0..len(raw) of ``raw``, the offset in
    that text's UTF-8 (an offset inside an invalid sequence moves past its U+FFFD)."""
    moved: list[int] = []
    out, start = 0, 0
    while True:
        try:
            raw[start:].decode("utf-8")
            bad = None
        except UnicodeDecodeError as error:
            bad = (start + error.start, start + error.end)
        good_end = len(raw) if bad is None else bad[0]
        moved.extend(out + offset for offset in range(good_end - start))
        out += good_end - start
        if bad is None:
            moved.append(out)
            return raw.decode("utf-8", errors="replace"), moved
        moved.append(out)  # the invalid sequence's start
        out += len("\ufffd".encode())
        moved.extend([out] * (bad[1] - bad[0] - 1))
        start = bad[1]


def teacher_batch(
    teacher_tokenizer: PreTrainedTokenizerBase,
    prompt_messages: Sequence[Sequence[Mapping[str, Any]]],
    contents: Sequence[str],
    *,
    max_length: int,
    eos_id: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The teacher's batch for the same texts: per row, the teacher's own chat template on ``prompt_messages``
    (with the tool schemas ``tools`` where given) with the generation prompt, then ``contents[row]`` tokenized by
    the teacher, then the teacher's EOS.

    The prompt and the content are tokenized together (the teacher sees its own tokenization of the whole text) and
    split where the content's bytes begin, found from the ids' own bytes (``token_byte_spans``'s rules): the bytes
    of all tokens must end with the content's UTF-8, and tokens that start before it are the prompt's. When the
    teacher merges the end of the prompt with the start of the content into one token (e.g. a template ending in a
    newline and a content starting with a newline and spaces), that token stays in the prompt and the content's
    tokens start after its bytes: their spans then start past 0, and those first bytes have no teacher token (the
    spans still end at the content's end, where the student's do).

    Returns ``input_ids``, ``attention_mask``, ``labels`` (``(B, L)``, left-padded like ``ChatMLCollator``; labels are
    the content tokens and the EOS, ``-100`` on the prompt and padding), ``completion_ids`` (per row: the labelled
    ids) and ``completion_spans`` (their byte spans in ``contents[row].encode()``, the EOS zero-width at its end).
    ``eos_id`` defaults to the tokenizer's EOS. Longer than ``max_length``: the prompt loses its beginning; a
    completion that does not fit with one prompt token is a ``ValueError``.
    """
    eos = teacher_tokenizer.eos_token_id if eos_id is None else eos_id
    if eos is None:
        raise ValueError("The teacher's tokenizer has no EOS token; pass eos_id (the id ending its turn).")
    if not getattr(teacher_tokenizer, "chat_template", None):
        raise ValueError(
            f"The teacher's tokenizer {getattr(teacher_tokenizer, 'name_or_path', '')!r} has no chat template; the "
            "teacher reads each prompt through its own template. Set teacher_tokenizer.chat_template."
        )
    if len(prompt_messages) != len(contents):
        raise ValueError(f"{len(prompt_messages)} prompts but {len(contents)} contents; give one content per prompt.")
    token_bytes = _TokenBytes(teacher_tokenizer)
    rows, labels, completion_ids, completion_spans = [], [], [], []
    for row, (messages, content) in enumerate(zip(prompt_messages, contents, strict=True)):
        prompt = render_chat(teacher_tokenizer, messages, add_generation_prompt=True, tools=tools)
        ids = list(teacher_tokenizer(prompt + content, add_special_tokens=False)["input_ids"])
        num_prompt, spans = _split_content(token_bytes, ids, content.encode(), row)
        completion = [*ids[num_prompt:], eos]
        if len(completion) >= max_length:
            raise ValueError(
                f"Row {row}: the teacher's tokens of the completion ({len(completion)}, EOS included) do not fit "
                f"max_length={max_length} with a prompt token; raise the teacher's max_length to at least "
                f"{len(completion) + 1}."
            )
        prompt_ids = ids[:num_prompt]
        kept = prompt_ids[max(len(prompt_ids) - (max_length - len(completion)), 0) :]
        rows.append([*kept, *completion])
        labels.append([IGNORE_INDEX] * len(kept) + completion)
        completion_ids.append(completion)
        completion_spans.append(spans + [(len(content.encode()),) * 2])
    pad = teacher_tokenizer.pad_token_id if teacher_tokenizer.pad_token_id is not None else eos
    return {
        "input_ids": left_pad(rows, pad),
        "attention_mask": left_pad([[1] * len(ids) for ids in rows], 0),
        "labels": left_pad(labels, IGNORE_INDEX),
        "completion_ids": completion_ids,
        "completion_spans": completion_spans,
    }


def _split_content(token_bytes: _TokenBytes, ids: list[int], content: bytes, row: int) -> tuple[int, list[Span]]:
    """How many of ``ids`` (a prompt followed by ``content``) are the prompt's, and the spans of the rest in
    ``content``."""
    spans, decoded = _spans(token_bytes.content_pieces(ids) if ids else [], len(ids))
    if not decoded.endswith(content):
        raise ValueError(
            f"Row {row}: the teacher's tokens of the text end with {_lossy(decoded[-len(content) :][-80:])!r}, not "
            f"the content's {_lossy(content[-80:])!r}: its tokenizer does not keep the text (a normalizer, or "
            "unknown tokens without byte fallback), so byte spans cannot line up. Use a teacher whose tokenizer "
            "round-trips text (byte-level BPE, or SentencePiece with byte fallback)."
        )
    boundary = len(decoded) - len(content)
    num_prompt = sum(1 for start, _ in spans if start < boundary)
    return num_prompt, [(start - boundary, end - boundary) for start, end in spans[num_prompt:]]
