"""The toy tasks' BPE teacher tokenizer (lightning_gkd/assets/toy_bpe): the chat text it learns its merges on, and
how it pairs with the student's byte tokenizer (the figures its manifest records)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_gkd.data.tokenizer import build_chatml_tokenizer
from lightning_gkd.ops.cross_tokenizer.aligned_row_loss import matched_vocabulary
from lightning_gkd.toy.tasks import ToyTask

# BPE merges of the shipped toy_bpe teacher's tokenizer: "user", "assistant" (11 merges) and the 29 most frequent
# 2-digit strings, so 83% of the test answers split differently from bytes (2.56 teacher tokens against 3.52 bytes).
# Two digits per token make the task harder for the 4x128 teacher (each token's carry depends on the next digits):
# it stops at 0.94 validation / 0.89 test exact match after 5000 steps where the byte teacher reaches 0.98, and longer
# schedules overfit (12000 steps: 0.90). With 200 merges (all 2-digit and 99 3-digit strings) it was at 4% after
# 7500 steps.
BPE_MERGES = 40


def training_corpus(task: ToyTask) -> list[str]:
    """The chat text (ChatML) of ``task``'s default training split: what the BPE tokenizer learns its merges on (never
    the held-out rows; a longer training split starts with these rows, so the tokenizer does not depend on it)."""
    template = build_chatml_tokenizer()
    return [str(template.apply_chat_template(row["messages"], tokenize=False)) for row in task.rows("train")]


def tokenizer_pairing(student_tokenizer: Any, teacher_tokenizer: Any, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How two tokenizers split ``rows``' answers: vocabulary sizes, token strings both hold, mean tokens per answer
    and the share of answers split differently."""
    student_ids, _ = matched_vocabulary(student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab())
    answers = [row["answer"] for row in rows]
    split = {
        role: [tok.convert_ids_to_tokens(tok(answer, add_special_tokens=False)["input_ids"]) for answer in answers]
        for role, tok in (("student", student_tokenizer), ("teacher", teacher_tokenizer))
    }
    return {
        "student_vocabulary": len(student_tokenizer),
        "teacher_vocabulary": len(teacher_tokenizer),
        "shared_token_strings": len(student_ids),
        "answers": f"{len(rows)} test rows",
        "student_tokens_per_answer": round(sum(map(len, split["student"])) / len(rows), 3),
        "teacher_tokens_per_answer": round(sum(map(len, split["teacher"])) / len(rows), 3),
        "answers_split_differently": round(
            sum(s != t for s, t in zip(split["student"], split["teacher"], strict=True)) / len(rows), 4
        ),
    }
