"""Bundled preference pairs built from the toy addition task: the correct sum is chosen, a wrong one rejected."""

from __future__ import annotations

import random

from lightning_gkd.toy.addition import addition_rows


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong number for ``answer`` drawn from ``rng``: uniform over ``[0, 2 * 10**len(answer))``, never the answer.

    The wrong numbers are random, about half of them a digit longer than the answer, so a policy learns to tell
    them apart from surface features well before it can add; that keeps the bundled DPO run short.
    """
    while (candidate := str(rng.randrange(2 * 10 ** len(answer)))) == answer:
        pass
    return candidate


def addition_preference_rows(split: str = "train", num_rows: int | None = None, *, seed: int = 1234) -> list[dict]:
    """Preference rows of the toy addition ``split``: ``{"prompt": [user turn(s)], "chosen": [assistant turn with
    the correct sum], "rejected": [the same turn with a wrong sum], "answer": the correct sum}``.

    The prompts are those of ``addition_rows(split, num_rows)`` (disjoint splits); ``seed`` picks the wrong sums, so
    the rows are deterministic.
    """
    rows = []
    for index, row in enumerate(addition_rows(split, num_rows)):
        *prompt, reply = row["messages"]
        answer = str(row["answer"])
        if reply.get("role") != "assistant" or answer not in reply["content"]:
            raise ValueError(
                f"toy {split} row {index}: expected the last message to be the assistant's and to "
                f"contain the answer {answer!r}, got {reply!r}."
            )
        wrong = wrong_answer(answer, random.Random(f"{seed}:{split}:{index}"))
        # Replace the last occurrence: the answer comes at the end of the reply.
        head, _, tail = reply["content"].rpartition(answer)
        rejected = {**reply, "content": f"{head}{wrong}{tail}"}
        rows.append({"prompt": prompt, "chosen": [dict(reply)], "rejected": [rejected], "answer": answer})
    return rows
