"""A formatting function the data tests import by dotted path (``helpers.formatting.qa_to_chat``), as a user's
config names one of theirs."""

CALLS: list[int] = []


def qa_to_chat(row, *, system=None):
    """A formatter of (question, answer) rows; imported by dotted path from the config tests."""
    CALLS.append(1)
    out = {"prompt": row["question"], "completion": row["answer"]}
    if system:
        out["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": row["question"]}]
    return out
