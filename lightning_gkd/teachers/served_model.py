"""One model on a vLLM OpenAI-compatible server, as every served teacher reaches it: the URL and its HTTP client
(retries, ``lightning_gkd.teachers.http``), the served model's name and ``max_model_len`` (``GET /v1/models``, read
once), the tokenizer probe, the rows of a batch to send, and a thread pool for one request per row.

Shared by ``ServerTeacher`` and ``ServerSampler`` (``teachers.server``: top-k log-probs and completions from a
generative server) and ``HiddenServerTeacher`` (``teachers.hidden_server``: final hidden states from a pooling
server).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from lightning_gkd.teachers.http import (
    JsonClient,
    TeacherRequestError,
    check_number,
    map_concurrently,
    normalize_url,
)

#: text whose tokenization the server and the student's tokenizer must agree on (digits, spaces, newlines, tabs,
#: punctuation, accents, CJK, an emoji; the tokenizer's special tokens are appended)
PROBE_TEXT = "Hello, world!\n  12 + 34 = 46\tÜber café; naïve? 日本語 🙂 (x_1 - y) ** 2 {'k': [v]}"

_T = TypeVar("_T")


class ServedModel:
    """``model`` (None: the only model served) on the server at ``url``; ``hint`` (how to start the server) ends
    every "did not answer" message. ``timeout``, ``concurrency``, ``retries``, ``backoff``: as the teacher specs
    (``teacher.timeout`` ...). No request is made before the first call that needs one."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        timeout: float = 60.0,
        concurrency: int = 4,
        retries: int = 4,
        backoff: float = 1.0,
        hint: str = "",
    ) -> None:
        self.url = normalize_url(url)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(
                f"teacher.model must be the served model's name (see GET /v1/models) or null, got {model!r}."
            )
        check_number("teacher.concurrency", concurrency, 1, "rows sent to the server at once", integer=True)
        check_number("teacher.retries", retries, 0, "retries of a transient failure; 0: none", integer=True)
        check_number("teacher.timeout", timeout, 1e-3, "seconds a request may take")
        check_number("teacher.backoff", backoff, 0, "seconds before the first retry, doubled after each")
        self.model = model
        self.timeout, self.backoff = float(timeout), float(backoff)
        self.concurrency, self.retries = concurrency, retries
        #: the server's ``max_model_len`` (from ``GET /v1/models``), once known
        self.max_model_len: int | None = None
        self.client = JsonClient(self.url, timeout=self.timeout, retries=retries, backoff=self.backoff, hint=hint)
        self._resolved = False  # model and max_model_len read from GET /v1/models
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def name(self) -> str:
        """``model``, checked against ``GET /v1/models`` once (None: the one model served)."""
        if self._resolved and self.model is not None:
            return self.model
        served = self.client.get("/v1/models").get("data", [])
        names = [str(entry["id"]) for entry in served]
        if self.model is None:
            if len(names) != 1:
                raise ValueError(
                    f"The teacher server at {self.url} serves {len(names)} models ({', '.join(names) or 'none'}): "
                    "name one with teacher.model."
                )
            self.model = names[0]
        if self.model not in names:
            raise ValueError(
                f"The teacher server at {self.url} does not serve teacher.model={self.model!r}; it serves "
                f"{', '.join(names) or 'no model'}."
            )
        self.max_model_len = int(served[names.index(self.model)].get("max_model_len") or 0) or None
        self._resolved = True
        return self.model

    def check_tokenizer(self, tokenizer: Any) -> list[int] | None:
        """The server tokenizes the probe text like ``tokenizer`` (ValueError naming both id lists otherwise); its ids,
        or None with a warning when the server has no tokenizer (``--skip-tokenizer-init``)."""
        model = self.name()
        text = probe_text(tokenizer)
        try:
            answer = self.client.post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        except TeacherRequestError as error:
            if "tokenizer" not in error.message.lower():
                raise
            warnings.warn(
                f"The teacher server at {self.url} has no tokenizer (--skip-tokenizer-init): its tokenizer cannot be "
                "compared with the student's; make sure the teacher was trained with the same one.",
                stacklevel=3,
            )
            return None
        theirs = [int(i) for i in answer["tokens"]]
        ours = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if theirs != ours:
            first = next(
                (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours))
            )
            raise ValueError(
                f"The teacher server at {self.url} (model {model!r}) tokenizes differently from the student's "
                f"tokenizer: {text!r} is {theirs} there and {ours} here (first difference at token {first}). Serve "
                "a teacher that shares the student's tokenizer (--tokenizer <the student's tokenizer folder>)."
            )
        return theirs

    def check_length(self, tokens: int, new_tokens: int) -> None:
        """ValueError when a row of ``tokens`` (+ ``new_tokens`` to generate) does not fit ``max_model_len``."""
        if self.max_model_len is not None and tokens + new_tokens > self.max_model_len:
            raise ValueError(
                f"A row of {tokens} tokens (+{new_tokens} new) does not fit the teacher server's max_model_len="
                f"{self.max_model_len} ({self.url}). Restart it with --max-model-len {tokens + new_tokens} or more, "
                "or lower data.max_length / max_new_tokens."
            )

    def map(self, call: Callable[[Any, threading.Event], _T], jobs: Sequence[Any]) -> list[_T]:
        """``call(job, abort)`` for every job on the pool (``map_concurrently``: the first failure stops the rest)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="lightning-gkd-teacher")
            pool = self._pool
        return map_concurrently(pool, call, jobs)

    def close(self) -> None:
        """Shut the thread pool down (a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self) -> dict[str, Any]:  # picklable (spawned DDP workers): no pool or lock in the state
        state = dict(self.__dict__)
        state["_pool"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def probe_text(tokenizer: Any) -> str:
    specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []]
    return PROBE_TEXT + "".join(specials)


def scored_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, *, owner: str
) -> list[tuple[int, list[int], list[int]]]:
    """What to send for the True ``positions`` ``(B, L)`` of a left-padded batch: per row with any, ``(row, its
    tokens from the first real one through the token its last position predicts, the positions' indices in those
    tokens)``. ValueError (naming ``owner``) for a position that is not a real token followed by a real token."""
    ids, mask, where = input_ids.cpu(), attention_mask.cpu().bool(), positions.cpu().bool()
    rows: list[tuple[int, list[int], list[int]]] = []
    for row in range(ids.shape[0]):
        columns = where[row].nonzero().flatten()
        if columns.numel() == 0:
            continue
        start = int(mask[row].int().argmax()) if bool(mask[row].any()) else ids.shape[1]
        end = int(columns[-1]) + 2  # through the token the last position predicts
        if int(columns[0]) < start or end > ids.shape[1] or not bool(mask[row, start:end].all()):
            raise ValueError(
                f"{owner}: row {row} has positions {columns.tolist()} outside its tokens (attention "
                f"{mask[row].int().tolist()}): a position must be a real token followed by a real token."
            )
        rows.append((row, ids[row, start:end].tolist(), (columns - start).tolist()))
    return rows
