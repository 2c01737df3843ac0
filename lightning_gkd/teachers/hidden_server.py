"""A teacher served as final hidden states (``teacher.kind=server``, ``signal: hidden``): vLLM's pooling runner
on the generative teacher returns, per token, the decoder's output after the final norm (what the head multiplies);
the student process holds only the teacher's head (``lightning_gkd.models.head.load_output_head``: the head tensors
read from the teacher's safetensors) and computes the exact full-vocabulary loss, any β.

Start the server with per-token pooling and no activation (no L2 normalisation of the states)::

    python -m vllm.entrypoints.openai.api_server --model <teacher> --runner pooling --convert embed \\
        --pooler-config '{"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": false}'

A batch's rows (token ids without padding, each through its last supervised position) go to ``POST /pooling`` in
``concurrency`` requests of several rows (``encoding_format: base64``, ``embed_dtype``: ``dtype``, little-endian);
the answer holds ``len(ids) × H`` numbers per row. 2H bytes per token in bf16 (3 KB at
H = 1536) against 4V bytes of float32 logits (608 KB at V = 152k).
"""

from __future__ import annotations

import base64
import logging
import math
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_gkd.ops.hf.heads import LogitHead
from lightning_gkd.teachers.hidden import HiddenStateTeacher
from lightning_gkd.teachers.http import TeacherRequestError
from lightning_gkd.teachers.served_model import ServedModel, scored_rows

__all__ = ["HiddenServerTeacher", "WIRE_DTYPES", "pooling_start_command"]

log = logging.getLogger(__name__)

#: the dtypes the states travel in (vLLM's ``embed_dtype``) and their bytes per number
WIRE_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
POOLER_CONFIG = '{"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": false}'


def pooling_start_command(url: str) -> str:
    """The command that starts a vLLM pooling server answering at ``url`` with per-token final hidden states."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (
        "python -m vllm.entrypoints.openai.api_server --model <teacher folder or hub id> --runner pooling "
        f"--convert embed --pooler-config '{POOLER_CONFIG}' --host {parts.hostname} --port {port}"
    )


def decode_states(data: str, dtype: str, tokens: int) -> torch.Tensor:
    """``(tokens, H)`` float32 from vLLM's base64 answer (little-endian ``dtype`` numbers, row-major)."""
    raw = base64.b64decode(data)
    if dtype == "bfloat16":
        values = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int16)).view(torch.bfloat16)
    else:
        values = torch.from_numpy(np.frombuffer(raw, dtype="<f4" if dtype == "float32" else "<f2").copy())
    if tokens == 0 or values.numel() % tokens:
        raise ValueError(f"The pooling answer holds {values.numel()} numbers, not a multiple of its {tokens} tokens.")
    return values.float().reshape(tokens, -1)


class HiddenServerTeacher(HiddenStateTeacher):
    """A dense ``Teacher`` whose final hidden states come from a vLLM pooling server at ``url`` serving ``model``
    (None: the only one), and whose head is read here from ``head``: a folder or hub id holding the teacher's
    safetensors (None: the served model's name, when that is a local folder), or a ``LogitHead``.

    ``dtype``: what the states travel in (``float32``, ``bfloat16``: 2H bytes a token, ``float16``).
    ``timeout``, ``concurrency``, ``retries``, ``backoff``: as ``ServerTeacher`` (a server that stays down raises
    ``TeacherUnavailable``; ``TeacherOutage`` then checkpoints). ``check`` probes the server before training."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        head: str | Path | LogitHead | None = None,
        dtype: str = "bfloat16",
        timeout: float = 60.0,
        concurrency: int = 4,
        retries: int = 4,
        backoff: float = 1.0,
    ) -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(
                f"teacher.dtype must be one of {', '.join(WIRE_DTYPES)} (the states' wire dtype), got {dtype!r}."
            )
        self.server = ServedModel(
            url,
            model,
            timeout=timeout,
            concurrency=concurrency,
            retries=retries,
            backoff=backoff,
            hint="Start it with: " + pooling_start_command(url),
        )
        self.url = self.server.url
        self.dtype = dtype
        self._head_given = isinstance(head, LogitHead)
        self.head_source = None if isinstance(head, LogitHead) else head
        super().__init__(head if isinstance(head, LogitHead) else None)
        #: bytes of hidden states received so far (the payload, decoded), and the tokens they cover
        self.payload_bytes = 0
        self.payload_tokens = 0
        self._counter_lock = threading.Lock()

    # -- the head ---------------------------------------------------------------------------------------------------
    def load_head(self) -> LogitHead:
        from lightning_gkd.models.head import read_output_head

        source = self.head_source
        if source is None:
            name = self.server.name()
            if not (Path(name) / "config.json").is_file():
                raise ValueError(
                    f"The teacher server at {self.url} serves {name!r}, which is not a local folder: give the "
                    "teacher's weights for its head with teacher.head=<folder or hub id> (only its head tensors are "
                    "read)."
                )
            source = name
        head, read = read_output_head(source)
        log.info("Teacher head for %s: %s.", self.url, read.summary())
        return head

    # -- probe ------------------------------------------------------------------------------------------------------
    def check(self, tokenizer: Any, vocab_size: int) -> None:
        """Before training: the server is up, serves ``model`` with the student's tokenizer, answers per-token
        states of the head's width that are not L2-normalised, and the head has the student's ``vocab_size``.
        Raises ``TeacherUnavailable`` (down) or ``ValueError`` naming what does not match and what to do."""
        self.server.client.get("/health")
        model = self.server.name()
        self.server.check_tokenizer(tokenizer)
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"The teacher head read from {self.head_source or model!r} has {self.vocab_size} rows but the "
                f"student's vocabulary has {vocab_size} tokens: serve a teacher with the student's vocabulary."
            )
        probe = [int(i) for i in tokenizer("Hello, world! 12 + 34 = 46", add_special_tokens=False)["input_ids"]]
        probe = probe[: self.server.max_model_len or len(probe)] or [0]
        states = self._post(model, [probe], None)[0]
        if states.shape[1] != self.hidden_size:
            raise ValueError(
                f"The teacher server at {self.url} (model {model!r}) answers states of {states.shape[1]} features, but "
                f"the head read from {self.head_source or model!r} takes {self.hidden_size}: serve the model the head "
                "comes from."
            )
        if not bool(torch.isfinite(states).all()):
            raise ValueError(f"The teacher server at {self.url} answered non-finite hidden states on a probe row.")
        norms = states.norm(dim=-1)
        if self.hidden_size > 1 and bool(torch.allclose(norms, torch.ones_like(norms), atol=1e-3)):
            raise ValueError(
                f"The teacher server at {self.url} answers L2-normalised states (every norm is 1): it applies the "
                f"pooler's activation. Restart it with --pooler-config '{POOLER_CONFIG}'."
            )

    # -- scoring ----------------------------------------------------------------------------------------------------
    def read_states(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` float32 states at the True ``positions`` (row-major). The rows with any position are split into
        ``concurrency`` requests sent at once, each a batch of rows (one HTTP request per row cost ~4x more here)."""
        rows = scored_rows(batch["input_ids"], batch["attention_mask"], positions, owner="HiddenServerTeacher")
        if not rows:
            return torch.zeros(0, self.hidden_size)
        # a state depends only on the tokens up to it: send each row through its last position
        jobs = [(tokens[: indices[-1] + 1], indices) for _, tokens, indices in rows]
        model = self.server.name()
        self.server.check_length(max(len(tokens) for tokens, _ in jobs), 0)
        size = math.ceil(len(jobs) / self.server.concurrency)
        groups = [jobs[start : start + size] for start in range(0, len(jobs), size)]

        def send(group: list[tuple[list[int], list[int]]], abort: threading.Event) -> list[torch.Tensor]:
            states = self._post(model, [tokens for tokens, _ in group], abort)
            return [row[indices] for row, (_, indices) in zip(states, group, strict=True)]

        return torch.cat([states for answer in self.server.map(send, groups) for states in answer])

    def _post(self, model: str, inputs: list[list[int]], abort: threading.Event | None) -> list[torch.Tensor]:
        """Per row of ``inputs`` (token ids), its ``(len, H)`` float32 states."""
        body = {
            "model": model,
            "input": inputs,
            "task": "token_embed",
            "use_activation": False,
            "encoding_format": "base64",
            "embed_dtype": self.dtype,
            "endianness": "little",
        }
        try:
            answer = self.server.client.post("/pooling", body, abort=abort)
        except TeacherRequestError as error:
            if error.status == 404 or "pooling" in error.message.lower() or error.param == "task":
                raise ValueError(
                    f"The teacher server at {self.url} does not serve per-token hidden states ({error.message}). "
                    f"Start it as a pooling server: {pooling_start_command(self.url)}"
                ) from None
            raise
        items = sorted(answer["data"], key=lambda item: int(item["index"]))
        if len(items) != len(inputs):
            raise ValueError(f"The teacher server at {self.url} answered {len(items)} rows for {len(inputs)} sent.")
        states = [
            decode_states(item["data"], self.dtype, len(tokens)) for item, tokens in zip(items, inputs, strict=True)
        ]
        with self._counter_lock:
            self.payload_bytes += sum(row.numel() for row in states) * WIRE_DTYPES[self.dtype]
            self.payload_tokens += sum(len(tokens) for tokens in inputs)
        return states

    def close(self) -> None:
        self.server.close()

    def __getstate__(self) -> dict[str, Any]:  # picklable (spawned DDP workers): a head read from files is re-read
        state = dict(self.__dict__)
        state["_counter_lock"] = None
        if not self._head_given:
            state["_head"], state["_heads"] = None, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._counter_lock = threading.Lock()
