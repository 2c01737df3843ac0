"""``VLLMProcessEngine`` (``producer=vllm``): a vLLM engine in its own process, on its own CPU cores (``cpus``) or
GPU (``device``), for the asynchronous producer.

The engine is built from the student's config alone (dummy weights) and takes every version's weights as one
``WeightSnapshot``: flat buffers in shared memory, which the child maps (no copy through the pipe) and loads with
vLLM's ``reload_weights`` (``samplers.vllm_engine.reload_on_worker``), then resets its prefix cache. Requests are
token ids with one seed per row (``derive_seed(seed, row)``, as ``VLLMSampler``), so a run's samples depend on the
seed and the weights alone. A child that dies, or answers nothing for ``request_timeout`` seconds, raises
``RolloutEngineUnavailable`` (a ``TeacherUnavailable``: the run stops on every rank with a checkpoint).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from lightning_gkd.asynchronous.engines import RolloutEngine, RolloutEngineUnavailable
from lightning_gkd.asynchronous.snapshot import WeightSnapshot
from lightning_gkd.models.loading import vocab_size
from lightning_gkd.ops.decoding.sampling import derive_seed, eos_ids, validate_sampling_args
from lightning_gkd.ops.hf.forward import EosTokenId, resolve_eos_token_id, unwrap
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.vllm import VLLMSampler, check_vllm_temperature, completion_tensors, import_vllm
from lightning_gkd.samplers.vllm_engine import (
    engine_options,
    memory_knob,
    reload_on_worker,
    request_options,
    sampled_logprobs,
    shutdown_engine,
)

__all__ = ["VLLMProcessEngine"]


class VLLMProcessEngine(RolloutEngine):
    """A vLLM engine in a child process. Sampling options are ``VLLMSampler``'s; engine options:

    * ``cpus``: the CPU cores the child runs on (its threads: one per core); None: the cores this process may use.
    * ``device``: the GPU the child uses (``CUDA_VISIBLE_DEVICES`` in the child); None: vLLM's default.
    * ``max_model_len``, ``max_num_seqs``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``dtype``,
      ``enforce_eager``, ``prefix_caching``, ``engine_kwargs``: as ``VLLMSampler``'s.
    * ``start_timeout``, ``request_timeout``: seconds to wait for the child to start, and for any answer.
    """

    remote = True

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        cpus: Sequence[int] | None = None,
        device: int | str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        dtype: str | None = None,
        enforce_eager: bool | None = None,
        prefix_caching: bool = True,
        engine_kwargs: Mapping[str, Any] | None = None,
        start_timeout: float = 600.0,
        request_timeout: float = 600.0,
    ) -> None:
        validate_sampling_args(max_new_tokens, temperature, top_k, top_p)
        check_vllm_temperature(temperature, owner="producer=vllm", fallback="producer=hf")
        self.check_available()
        if cpus is not None and (not cpus or any(int(cpu) < 0 for cpu in cpus)):
            raise ValueError(f"producer.cpus must name at least one CPU core (ids >= 0), got {list(cpus)!r}.")
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.cpus = [int(cpu) for cpu in cpus] if cpus is not None else None
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.prefix_caching = prefix_caching
        self.engine_kwargs = dict(engine_kwargs or {})
        self.start_timeout, self.request_timeout = start_timeout, request_timeout
        self._process: Any = None
        self._conn: Connection | None = None
        self._folder: tempfile.TemporaryDirectory | None = None
        self._request: dict[str, Any] = {}
        self._eos: EosTokenId = None
        self._last_stats: dict[str, float] = {}
        #: Seconds the child took to start its engine.
        self.start_seconds = 0.0

    @staticmethod
    def check_available() -> None:
        VLLMSampler.check_available()

    # -- the trainer's side ----------------------------------------------------------------------------------------
    def start(self, student: nn.Module, *, max_model_len: int | None = None) -> None:
        if self._process is not None:
            return
        config: Any = unwrap(student).config
        self._eos = resolve_eos_token_id(student, self.tokenizer)
        self._request = request_options(
            vocab=int(getattr(config, "vocab_size", 0) or 0),
            shared_rows=vocab_size(student),
            stop_ids=eos_ids(self._eos),
            max_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            greedy=False,
        )
        self.max_model_len = (
            self.max_model_len or max_model_len or int(getattr(config, "max_position_embeddings", 2048))
        )
        dtype = self.dtype or _dtype_name(next(student.parameters()).dtype)
        self._folder = tempfile.TemporaryDirectory(prefix="lightning_gkd_producer_")
        config.to_json_file(os.path.join(self._folder.name, "config.json"))  # no generation_config: no hidden defaults
        spec = {
            "folder": self._folder.name,
            "cpus": self.cpus,
            "device": self.device,
            "long": self.max_model_len > int(getattr(config, "max_position_embeddings", self.max_model_len)),
            "engine": {
                "dtype": dtype,
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "tensor_parallel_size": 1,
                "enforce_eager": self.enforce_eager,
                "prefix_caching": self.prefix_caching,
                "engine_kwargs": self.engine_kwargs,
            },
        }
        context = torch.multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(child, spec), name="lightning_gkd_vllm_producer", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        try:
            self.start_seconds = float(self._call(None, timeout=self.start_timeout, what="start"))
        except RolloutEngineUnavailable as error:
            self.close()
            raise RuntimeError(
                f"producer=vllm: the vLLM engine process failed to start ({error}). If it ran out of memory, lower "
                f"producer.kv_cache_memory_bytes (CPU) or producer.gpu_memory_utilization (GPU), or max_num_seqs "
                f"(now {self.max_num_seqs}); max_model_len is {self.max_model_len}."
            ) from error

    def load_weights(self, snapshot: WeightSnapshot) -> float:
        return float(self._call(("weights", snapshot), timeout=self.request_timeout, what="weight load"))

    def sample(
        self, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int, vision: VisionRows | None = None
    ) -> dict[str, Any]:
        if vision is not None and any(vision):
            raise ValueError(
                "producer=vllm does not sample from prompts with images; use producer=hf for a vision-language student."
            )
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.cpu(), prompt_attention_mask.cpu(), strict=True)]
        longest = max((len(ids) for ids in rows), default=0)
        assert self.max_model_len is not None
        if longest + self.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"producer=vllm: a prompt of {longest} tokens plus max_new_tokens={self.max_new_tokens} exceeds the "
                f"engine's max_model_len={self.max_model_len}. Raise producer.max_model_len, or lower data.max_length."
            )
        seeds = [derive_seed(seed, row) % (2**31) for row in range(len(rows))]
        tokens, logprobs, seconds = self._call(
            ("generate", rows, seeds, self._request), timeout=self.request_timeout, what="sampling"
        )
        self._last_stats = {"engine_sample_seconds": float(seconds)}
        return completion_tensors(prompts, prompt_attention_mask, tokens, logprobs, self.tokenizer, self._eos)

    def last_stats(self) -> dict[str, float]:
        return dict(self._last_stats)

    def close(self) -> None:
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is not None and conn is not None:
            try:
                if process.is_alive():
                    conn.send(("close",))
                    if conn.poll(30):
                        conn.recv()
            except (OSError, EOFError):
                pass
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
            conn.close()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (None when not started)."""
        return None if self._process is None else self._process.pid

    def _call(self, message: tuple[Any, ...] | None, *, timeout: float, what: str) -> Any:
        """Send ``message`` (None: only wait for the start's answer) and return the child's answer."""
        conn, process = self._conn, self._process
        if conn is None or process is None:
            raise RolloutEngineUnavailable(f"producer=vllm: the engine process is not running ({what}).")
        try:
            if message is not None:
                conn.send(message)
            deadline = time.monotonic() + timeout
            while not conn.poll(1.0):
                if not process.is_alive():
                    raise RolloutEngineUnavailable(
                        f"producer=vllm: the engine process (pid {process.pid}) exited with code {process.exitcode} "
                        f"during {what}."
                    )
                if time.monotonic() > deadline:
                    raise RolloutEngineUnavailable(
                        f"producer=vllm: the engine process (pid {process.pid}) did not answer within {timeout:g} s "
                        f"({what})."
                    )
            status, payload = conn.recv()
        except (OSError, EOFError) as error:
            raise RolloutEngineUnavailable(
                f"producer=vllm: lost the engine process (pid {process.pid}) during {what}: {error}."
            ) from error
        if status != "ok":
            raise RolloutEngineUnavailable(f"producer=vllm: the engine process failed during {what}: {payload}")
        return payload


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


# -- the child process -----------------------------------------------------------------------------------------------
def serve(conn: Connection, spec: Mapping[str, Any]) -> None:
    """The engine process: start the engine (answer ``("ok", seconds)`` or ``("error", text)``), then answer
    ``("weights", snapshot)``, ``("generate", rows, seeds, request options)`` and ``("close",)`` until closed."""
    cpus = spec["cpus"]
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    if spec["device"] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["device"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process
    if spec["long"]:
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    try:
        started = time.perf_counter()
        vllm = import_vllm()
        from transformers import AutoConfig
        from vllm.platforms import current_platform

        config = AutoConfig.from_pretrained(spec["folder"])
        options = engine_options(config, on_cpu=current_platform.is_cpu(), **spec["engine"])
        options["model"] = spec["folder"]
        try:
            llm = vllm.LLM(**options)
        except Exception as error:
            raise RuntimeError(f"{type(error).__name__}: {error} (memory: {memory_knob(options)})") from error
        # the first generate call sets up the CPU kernels: pay it here, not in the first step
        llm.generate(
            [vllm.inputs.TokensPrompt(prompt_token_ids=[0])], vllm.SamplingParams(max_tokens=2), use_tqdm=False
        )
        conn.send(("ok", time.perf_counter() - started))
    except BaseException as error:
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            shutdown_engine(llm, keep_process_group=False)
            return
        kind = message[0]
        try:
            if kind == "close":
                shutdown_engine(llm, keep_process_group=False)
                conn.send(("ok", None))
                return
            started = time.perf_counter()
            if kind == "weights":
                snapshot: WeightSnapshot = message[1]
                llm.collective_rpc(reload_on_worker, args=(snapshot.tensors(),))
                llm.reset_prefix_cache()  # no block computed with older weights is reused
                del snapshot
                conn.send(("ok", time.perf_counter() - started))
            elif kind == "generate":
                _, rows, seeds, request = message
                params = [vllm.SamplingParams(seed=seed, **request) for seed in seeds]
                outputs = llm.generate(
                    [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in rows], params, use_tqdm=False
                )
                tokens = [list(out.outputs[0].token_ids) for out in outputs]
                logprobs = [sampled_logprobs(out.outputs[0]) for out in outputs]
                conn.send(("ok", (tokens, logprobs, time.perf_counter() - started)))
            else:
                conn.send(("error", f"unknown request {kind!r}"))
        except Exception as error:
            conn.send(("error", f"{type(error).__name__}: {error}"))
