"""A teacher served by vLLM's OpenAI-compatible server (``teacher.kind=server``): its top-k log-probs at every
supervised position (``ServerTeacher``), and its completions for sequence-level KD (``ServerSampler``).

Start the server next to training, e.g. ``python -m vllm.entrypoints.openai.api_server --model <teacher>
--max-logprobs 20 --host 127.0.0.1 --port 8000`` (``--max-logprobs`` >= ``top_k``). Scoring sends each row's token
ids, without its padding, to ``POST /v1/completions`` with ``prompt_logprobs=top_k`` and ``max_tokens=1``; vLLM
answers ``prompt_logprobs``: one entry per prompt token, ``null`` for the first, else ``{"<token id>": {"logprob",
"rank", "decoded_token"}}`` holding the top-k tokens and, first, the prompt's own next token (so ``k + 1`` entries
when it is outside the top-k). Entry ``j`` is the distribution of token ``j`` given tokens ``< j``, under the
model's full softmax at temperature 1.

Rows are sent concurrently (``concurrency`` threads); transient failures are retried (``lightning_gkd.teachers.
http``), and a server that stays down raises ``TeacherUnavailable``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_gkd.ops.decoding.sampling import completion_batch, derive_seed, eos_ids, validate_sampling_args
from lightning_gkd.ops.decoding.speculative import check_verifiable
from lightning_gkd.ops.divergence.sparse_kd import MASKED_ID
from lightning_gkd.ops.hf.forward import EosTokenId
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.base import Sampler
from lightning_gkd.teachers.base import TeacherBase, TeacherUnavailable, TopKSignal
from lightning_gkd.teachers.http import TeacherRequestError, check_number, normalize_url, start_command
from lightning_gkd.teachers.served_model import ServedModel, scored_rows

__all__ = [
    "ServerBlockVerifier",
    "ServerSampler",
    "ServerTeacher",
    "TeacherRequestError",
    "TeacherUnavailable",
]


class ServerTeacher(TeacherBase):
    """A ``SparseTeacher`` backed by a vLLM OpenAI-compatible server at ``url`` (``http://host:port``; a trailing
    ``/v1`` is fine), serving ``model`` (None: the only model it serves).

    ``top_k``: tokens per position (<= the server's ``--max-logprobs``). ``timeout``: seconds a request may take.
    ``concurrency``: rows scored at once. ``retries``/``backoff``: a transient failure (connection refused or
    dropped, timeout, HTTP 5xx/429) is retried ``retries`` times, waiting ``backoff · 2^attempt`` seconds first
    (``retries + 1`` attempts in all), then ``TeacherUnavailable``. No request is made before ``check`` or ``topk``.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        top_k: int = 20,
        timeout: float = 60.0,
        concurrency: int = 4,
        retries: int = 4,
        backoff: float = 1.0,
    ) -> None:
        check_number("teacher.top_k", top_k, 1, "tokens per position; <= the server's --max-logprobs", integer=True)
        #: the connection (URL, client with retries, model name, thread pool), shared with ``ServerSampler``
        self.server = ServedModel(
            url,
            model,
            timeout=timeout,
            concurrency=concurrency,
            retries=retries,
            backoff=backoff,
            hint=f"Start it with: {start_command(normalize_url(url), top_k)}",
        )
        self.url = self.server.url
        self.top_k = top_k
        self.vocab_size: int | None = None
        #: whether the served model has rows past the student's vocabulary (``check``; None: not known), whose ids
        #: ``topk`` masks
        self.padded_vocabulary: bool | None = None

    @property
    def model(self) -> str | None:
        return self.server.model

    @property
    def max_model_len(self) -> int | None:
        """The server's ``max_model_len`` (from ``GET /v1/models``), once known."""
        return self.server.max_model_len

    # -- probe ------------------------------------------------------------------------------------------------------
    def check(self, tokenizer: Any, vocab_size: int) -> None:
        """Before training: the server is up, serves ``model``, allows ``top_k`` log-probs, tokenizes like
        ``tokenizer``, and takes every id of the student's ``vocab_size`` rows. Raises ``TeacherUnavailable`` (down)
        or ``ValueError`` naming the URL and both values of what does not match.

        A served model with *more* rows than the student (one tokenizer, the embedding padded further, as Qwen2.5-7B
        against 0.5B) is accepted: ``topk`` masks the ids it returns past ``vocab_size`` (``padded_vocabulary``
        says whether the probe saw such rows). A model with *fewer* rows (it rejects the student's last id) is
        refused: the student could sample tokens the teacher cannot score."""
        self.server.client.get("/health")
        model = self.server.name()
        theirs = self.server.check_tokenizer(tokenizer)
        probe = [vocab_size - 1, 0] if vocab_size > 1 else [0, 0]
        try:
            entries = self._prompt_logprobs(model, probe, None)
        except TeacherRequestError as error:
            if error.param == "prompt_logprobs" or "logprobs" in error.message:
                raise ValueError(
                    f"The teacher server at {self.url} does not return top_k={self.top_k} log-probs ({error.message}). "
                    f"Restart it with --max-logprobs {self.top_k} or more, or lower teacher.top_k."
                ) from None
            if "vocabulary" in error.message:
                raise ValueError(
                    f"The teacher server at {self.url} (model {model!r}) rejects token id {vocab_size - 1}: its "
                    f"vocabulary is smaller than the student's {vocab_size} tokens ({error.message})."
                ) from None
            raise
        returned = {int(token) for entry in entries[1:] for token in entry}
        if len(returned) < min(self.top_k, vocab_size):
            raise ValueError(
                f"The teacher server at {self.url} (model {model!r}) returned token ids {sorted(returned)} for "
                f"top_k={self.top_k}: fewer than {min(self.top_k, vocab_size)} ids."
            )
        self.padded_vocabulary = max(returned) >= vocab_size or None
        if theirs is not None and not self.padded_vocabulary:  # with a tokenizer vLLM rejects ids past its rows
            try:
                self._prompt_logprobs(model, [vocab_size, 0], None, top_k=1)
            except TeacherRequestError as error:
                if "vocabulary" not in error.message:
                    raise
                self.padded_vocabulary = False
            else:
                self.padded_vocabulary = True
        self.vocab_size = vocab_size

    # -- scoring ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def topk(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> TopKSignal:
        """The signal at the True ``positions`` ``(B, L)`` of ``batch`` (``input_ids``, ``attention_mask`` ``(B,
        L)``, left-padded): ``ids``/``logprobs`` ``(N, k)``, ``next_logprobs`` ``(N,)``, row-major, on the batch's
        device. Ties in log-probs are ordered by id (as ``lightning_gkd.ops.divergence.topk.topk_log_probs``).

        After ``check``, an id of the server's top-k past the student's vocabulary (a padded row of a larger served
        model) is masked: moved after the kept ids as ``MASKED_ID`` (−1) with log-prob −inf, so the top-k losses
        leave it out (``ops.divergence.sparse_kd``: its mass stays in the tail bucket) and ``ids[:, 0]`` is the
        teacher's most likely token among the student's."""
        input_ids = batch["input_ids"]
        # prompt_logprobs entry j is the distribution of token j given tokens < j: position i reads entry i + 1
        rows = [
            (prompt, [index + 1 for index in indices])
            for _, prompt, indices in scored_rows(
                input_ids, batch["attention_mask"], positions, owner="ServerTeacher.topk"
            )
        ]
        k = self.top_k
        if not rows:  # nothing supervised: no request
            empty = torch.zeros(0, k)
            return TopKSignal(empty.long(), empty, torch.zeros(0)).to(input_ids.device)
        model = self.server.name()
        self.server.check_length(max(len(prompt) for prompt, _ in rows), 1)
        top = max(max(prompt) for prompt, _ in rows)
        if self.vocab_size is not None and top >= self.vocab_size:  # such an id can crash a server without tokenizer
            raise ValueError(f"ServerTeacher.topk: token id {top} is outside the vocabulary ({self.vocab_size}).")
        scored = self.server.map(lambda job, abort: self._prompt_logprobs(model, job[0], abort), rows)
        out_ids, out_logprobs, following = [], [], []
        for (prompt, indices), entries in zip(rows, scored, strict=True):
            for index in indices:
                entry = entries[index]
                ranked = sorted(((-float(v["logprob"]), int(t)) for t, v in entry.items()))[:k]
                if len(ranked) < k:
                    raise ValueError(
                        f"The teacher server at {self.url} returned {len(ranked)} log-probs, not top_k={k}."
                    )
                kept = [(t, -v) for v, t in ranked if self.vocab_size is None or t < self.vocab_size]
                kept += [(MASKED_ID, -math.inf)] * (k - len(kept))
                out_ids.append([t for t, _ in kept])
                out_logprobs.append([v for _, v in kept])
                following.append(float(entry[str(prompt[index])]["logprob"]))
        device = input_ids.device
        return TopKSignal(
            torch.tensor(out_ids, dtype=torch.long).reshape(-1, k).to(device),
            torch.tensor(out_logprobs, dtype=torch.float32).reshape(-1, k).to(device),
            torch.tensor(following, dtype=torch.float32).to(device),
        )

    def block_verifier(self, accept_top_k: int) -> ServerBlockVerifier:
        """A verifier of speculative KD's drafts (``ops.decoding.speculative.BlockVerifier``) keeping a draft among
        the teacher's top-``accept_top_k``: ValueError unless ``accept_top_k <= top_k`` (the server then returns the
        whole top-K at every position). No request is made here."""
        check_verifiable(accept_top_k, self.top_k, self.url)
        return ServerBlockVerifier(self)

    def close(self) -> None:
        """Shut the thread pool down (a later call starts a new one)."""
        self.server.close()

    # -- internals --------------------------------------------------------------------------------------------------
    def _prompt_logprobs(
        self, model: str, prompt: list[int], abort: threading.Event | None, *, top_k: int | None = None
    ) -> list[dict[str, dict[str, Any]]]:
        """``prompt_logprobs`` of one prompt (entry 0, ``null``, kept as ``{}``)."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": top_k or self.top_k}
        answer = self.server.client.post("/v1/completions", {**body, "temperature": 0}, abort=abort)
        entries = answer["choices"][0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(prompt):
            raise ValueError(
                f"The teacher server at {self.url} returned no prompt_logprobs for a {len(prompt)}-token prompt "
                f"(got {type(entries).__name__}); is it a vLLM server?"
            )
        return [entry or {} for entry in entries]


class ServerBlockVerifier:
    """Speculative KD's verification by a served teacher (``ops.decoding.speculative.BlockVerifier``): per block one
    request per unfinished row, scoring its prompt, the tokens decided so far and the ``n`` drafts with
    ``prompt_logprobs=top_k``; the answer at draft ``i`` holds the teacher's top-``k`` (log-softmax at temperature
    1, over all its rows) and the draft's own log-prob. ``verify`` returns them at their ids, −inf at every other
    token and at ids past the student's vocabulary (a padded served model's rows).

    With ``accept_top_k <= top_k`` (``ServerTeacher.block_verifier`` refuses more) every keep/replace decision is
    the in-process teacher's, ties included. The replacement token is drawn (with the sampler's own seeded stream)
    from the teacher's sampling distribution restricted to those known tokens and renormalised: exact when the
    distribution's support lies among them (sampling ``top_k`` in ``[1, teacher.top_k]``, whatever the temperature),
    else it misses the teacher's mass outside its top-k (at temperature 1: ``1 − Σ`` of the top-k probabilities,
    small for a peaked teacher and a ``top_k`` of 20 or more). ``sampled_logprobs`` are computed from that same
    restricted distribution, the one sampled from."""

    def __init__(self, teacher: ServerTeacher) -> None:
        self.teacher = teacher
        self.tokens_read = 0
        self._rows: list[list[int]] = []
        self._model = ""

    def begin(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int) -> None:
        ids, mask = prompt_ids.cpu(), prompt_attention_mask.cpu().bool()
        self._rows = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
        self._model = self.teacher.server.name()
        # the longest request: a prompt, every completion token, and the one token vLLM generates after them
        self.teacher.server.check_length(max(len(row) for row in self._rows) + max_new_tokens, 1)
        rows = self.teacher.vocab_size
        top = max(max(row) for row in self._rows)
        if rows is not None and top >= rows:
            raise ValueError(f"ServerBlockVerifier: prompt token id {top} is outside the vocabulary ({rows}).")
        self.tokens_read = 0

    def verify(self, drafts: torch.Tensor, finished: torch.Tensor, vocab_size: int) -> torch.Tensor:
        batch, n = drafts.shape
        out = torch.full((batch, n, vocab_size), -math.inf, dtype=torch.float32)
        out[finished.cpu()] = 0.0  # rows past their EOS: never read
        jobs = [
            (row, self._rows[row] + [int(t) for t in drafts[row].tolist()])
            for row in range(batch)
            if not bool(finished[row])
        ]
        teacher = self.teacher

        def score(job: tuple[int, list[int]], abort: threading.Event) -> list[dict[str, dict[str, Any]]]:
            return teacher._prompt_logprobs(self._model, job[1], abort)

        answers = teacher.server.map(score, jobs)
        for (row, tokens), entries in zip(jobs, answers, strict=True):
            self.tokens_read += len(tokens)
            start = len(self._rows[row])  # entry j: the distribution of token j given tokens < j
            for i in range(n):
                entry = entries[start + i]
                known = [(int(t), float(v["logprob"])) for t, v in entry.items() if int(t) < vocab_size]
                if known:
                    ids, values = zip(*known, strict=True)
                    out[row, i, list(ids)] = torch.tensor(values, dtype=torch.float32)
        return out.to(drafts.device)

    def advance(self, tokens: torch.Tensor, drafted: int, more: bool) -> None:
        for row, decided in enumerate(tokens.cpu().tolist()):
            self._rows[row].extend(int(t) for t in decided)

    def finish(self) -> None:
        self._rows = []


class ServerSampler(Sampler):
    """Completions written by the teacher server (sequence-level KD), with the ``Sampler`` contract: the batch of
    ``ops.decoding.sampling.completion_batch``. The ``model`` argument is ignored (the server has the weights).

    Each row's request seed is ``derive_seed(seed, row)``, so a seed gives the same samples again (on the same
    server and model). ``sampled_logprobs`` are the server's log-probs of the sampled tokens: under vLLM's default
    ``--logprobs-mode raw_logprobs`` that is the teacher's full softmax at temperature 1 (before ``temperature``,
    ``top_k``, ``top_p``), not the distribution sampled from; a server started with ``--logprobs-mode
    processed_logprobs`` returns the latter. ``sampled_logprobs_problem`` says which (one probe request) for a
    consumer that needs the sampled distribution's log-probs (OPD's importance weights). The server needs its
    tokenizer (vLLM formats log-probs with it; not ``--skip-tokenizer-init``). Generation stops at
    ``eos_token_id`` (the student's; the server's own EOS is ignored) and rows are padded with ``pad_token_id``
    after it.
    """

    def __init__(
        self,
        teacher: ServerTeacher,
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int = 0,
    ) -> None:
        validate_sampling_args(max_new_tokens, temperature, top_k, top_p)
        self.teacher = teacher
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.eos_token_id: EosTokenId = eos_token_id
        self.pad_token_id = pad_token_id
        self._processed_logprobs: bool | None = None  # the server's --logprobs-mode, once probed

    def sampled_logprobs_problem(self) -> str | None:
        """None when ``sampled_logprobs`` are the log-probs of the distribution the server samples from, else why
        not. They are at temperature 1 without top-k / top-p (the raw softmax is then that distribution), and with
        any options on a server that returns processed log-probs (``--logprobs-mode processed_logprobs``). The mode
        is probed once: one token at ``top_k=1``, whose processed log-prob is exactly 0 (the only token left) and
        whose raw log-prob is the teacher's full-softmax log-prob of its most likely token, below 0."""
        if self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0:
            return None
        if self._processed_logprobs is None:
            self._processed_logprobs = self._probe_processed_logprobs()
        if self._processed_logprobs:
            return None
        return (
            f"the teacher server at {self.teacher.url} returns raw log-probs (the teacher's softmax at temperature 1; "
            f"vLLM's default --logprobs-mode raw_logprobs), not those of the distribution it samples from "
            f"(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p})"
        )

    def _probe_processed_logprobs(self) -> bool:
        server = self.teacher.server
        body = {
            "model": server.name(),
            "prompt": [self.pad_token_id],
            "max_tokens": 1,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "seed": 0,
        }
        logprobs = (server.client.post("/v1/completions", body)["choices"][0].get("logprobs") or {}).get(
            "token_logprobs"
        )
        if not logprobs:
            raise ValueError(f"The teacher server at {self.teacher.url} returned no log-probs; is it a vLLM server?")
        return abs(float(logprobs[0])) < 1e-4

    def sample(
        self,
        model: nn.Module | None,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        vision: VisionRows | None = None,
    ) -> dict[str, torch.Tensor]:
        self.refuse_images(vision)
        """Completions for left-padded ``prompts`` ``(B, P)``: the dict of ``completion_batch``, ``(B, P + N)``."""
        options = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        seeds = [derive_seed(seed, row) for row in range(prompts.shape[0])]
        return self._generate(prompts, prompt_attention_mask, options, seeds, self.max_new_tokens)

    def greedy(
        self,
        model: nn.Module | None,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
    ) -> dict[str, torch.Tensor]:
        """Greedy completions (same contract as ``sample``; ``sampled_logprobs`` are then the log-softmax)."""
        validate_sampling_args(max_new_tokens, 1.0, 0, 1.0)
        options = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
        return self._generate(prompts, prompt_attention_mask, options, [None] * prompts.shape[0], max_new_tokens)

    def close(self) -> None:
        self.teacher.close()

    def _generate(
        self,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        options: dict[str, float],
        seeds: Sequence[int | None],
        max_new_tokens: int,
    ) -> dict[str, torch.Tensor]:
        teacher, server = self.teacher, self.teacher.server
        model = server.name()
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompts.cpu(), prompt_attention_mask.cpu(), strict=True)]
        server.check_length(max((len(r) for r in rows), default=0), max_new_tokens)
        stop = eos_ids(self.eos_token_id)

        def generate(job: tuple[list[int], int | None], abort: threading.Event) -> tuple[list[int], list[float]]:
            prompt, seed = job
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_new_tokens,
                **options,
                "min_p": 0.0,  # explicit: a server's generation-config defaults apply to every field left out
                "repetition_penalty": 1.0,
                "stop_token_ids": stop,
                "ignore_eos": True,  # stop at the student's EOS only; vLLM still stops at stop_token_ids
                "return_token_ids": True,
                "logprobs": 0,
                "skip_special_tokens": False,
            }
            if seed is not None:
                body["seed"] = seed
            choice = server.client.post("/v1/completions", body, abort=abort)["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            rows = teacher.vocab_size
            if rows is not None and tokens and max(tokens) >= rows:  # a padded row of a larger served model
                raise ValueError(
                    f"The teacher server at {teacher.url} sampled token id {max(tokens)}, past the student's "
                    f"vocabulary ({rows} rows): a padded row of the served model, which a trained model gives ~0 "
                    "probability. Sample with top_k or top_p set (method.sampling.top_k), or check the served model."
                )
            logprobs = [float(v) for v in (choice.get("logprobs") or {}).get("token_logprobs", [])]
            if len(logprobs) != len(tokens):
                raise ValueError(
                    f"The teacher server at {teacher.url} returned {len(tokens)} tokens but "
                    f"{len(logprobs)} log-probs; is it a vLLM server that knows return_token_ids?"
                )
            return tokens, logprobs

        outputs = server.map(generate, list(zip(rows, seeds, strict=True)))
        width = max([1, *(len(tokens) for tokens, _ in outputs)])
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        values = torch.zeros(len(rows), width, dtype=torch.float32)
        for row, (tokens, logprobs) in enumerate(outputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            values[row, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
        return completion_batch(prompts, prompt_attention_mask, ids.to(prompts.device), self.eos_token_id, values)
