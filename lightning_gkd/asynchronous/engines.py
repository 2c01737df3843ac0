"""Rollout engines: what the asynchronous producer samples with, each holding its own copy of the student's weights
at one version (loaded from a ``WeightSnapshot``), independent of the live student the trainer keeps changing.

* ``InProcessEngine``: a copy of the student in this process, sampled by any ``Sampler`` (our KV-cache decoder by
  default). The producer's thread runs it; on a CPU it shares the cores with the trainer.
* ``VLLMProcessEngine`` (``asynchronous.vllm_process``): a vLLM engine in its own process, on its own cores or GPU.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import nn

from lightning_gkd.asynchronous.snapshot import WeightSnapshot
from lightning_gkd.models.weights import check_weights_exportable
from lightning_gkd.ops.hf.forward import is_peft_model, is_sharded
from lightning_gkd.ops.hf.model_inputs import VisionRows
from lightning_gkd.samplers.base import Sampler, SamplerFactory, build_sampler
from lightning_gkd.samplers.kv_cache import KVCacheSampler
from lightning_gkd.teachers.base import TeacherUnavailable

__all__ = ["EngineFactory", "InProcessEngine", "RolloutEngine", "RolloutEngineUnavailable"]


class RolloutEngineUnavailable(TeacherUnavailable):
    """The rollout engine's process stopped or stopped answering: the run cannot sample. Like a teacher server's
    outage, every rank stops before the step's update and ``TeacherOutage`` saves a checkpoint to resume from."""

    service = "The rollout engine"
    remedy = "Check the engine's memory and cores (its error above)"


class RolloutEngine(ABC):
    """Samples completions with the weights of the last ``WeightSnapshot`` it loaded.

    The producer calls ``start`` once (as fitting starts, with the live student: its config and first weights),
    then, in order, ``load_weights`` and ``sample`` from its own thread, and ``close`` at the end. ``sample``'s
    contract is ``Sampler.sample``'s (``completion_batch`` plus ``sampled_logprobs``), without the model argument."""

    #: whether ``sample`` takes prompts with images (``vision``)
    takes_images: ClassVar[bool] = False
    #: whether the engine lives in another process (its snapshots are put in shared memory; its outage stops the run)
    remote: ClassVar[bool] = False

    @abstractmethod
    def start(self, student: nn.Module, *, max_model_len: int | None = None) -> None:
        """Build the engine for ``student``'s architecture (its weights come with the first ``load_weights``)."""

    @abstractmethod
    def load_weights(self, snapshot: WeightSnapshot) -> float:
        """Replace the engine's weights by ``snapshot``'s; returns the seconds it took."""

    @abstractmethod
    def sample(
        self, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int, vision: VisionRows | None = None
    ) -> dict[str, Any]:
        """Completions for left-padded ``prompts`` ``(B, P)`` (``Sampler.sample``'s contract)."""

    def bind_teachers(self, sources: Mapping[str, Any]) -> None:
        """Take the method's teacher sources by name (an engine whose sampler consults the teacher)."""

    def end_rollout(self) -> None:
        """A multi-turn rollout ended: release what was kept for its turns (``Sampler.end_rollout``)."""

    def close(self) -> None:
        """Release the engine (a process, a copy of the model)."""

    def last_stats(self) -> dict[str, float]:
        """Figures of the last ``sample`` call, by name."""
        return {}

    def sampled_logprobs_problem(self) -> str | None:
        """Why ``sampled_logprobs`` are not the log-probs of the distribution sampled from, or None when they are."""
        return None


#: ``factory(tokenizer, max_new_tokens=, temperature=, top_k=, top_p=)`` -> ``RolloutEngine`` (an engine class or a
#: ``functools.partial`` of one; Hydra: ``producer=hf|vllm``, ``_partial_: true``).
EngineFactory = Callable[..., RolloutEngine]


class InProcessEngine(RolloutEngine):
    """A copy of the student in this process (same device and dtype), sampled by ``sampler`` (a ``Sampler`` factory,
    called with the tokenizer and the sampling options; default: ``KVCacheSampler``, our KV-cache decoder)."""

    takes_images = True

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        sampler: Sampler | SamplerFactory | None = None,
    ) -> None:
        self.sampler = build_sampler(
            sampler or KVCacheSampler,
            tokenizer,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        self.takes_images = self.sampler.takes_images  # type: ignore[misc]
        self.model: nn.Module | None = None
        self._parameters: dict[str, torch.Tensor] = {}

    def start(self, student: nn.Module, *, max_model_len: int | None = None) -> None:
        check_weights_exportable(student, owner="the in-process rollout engine")
        if is_sharded(student):
            raise ValueError(
                "producer=hf keeps a whole copy of the student in each process, which defeats sharding it with "
                "FSDP: use producer=vllm (an engine in its own process, loaded from the gathered weights), or "
                "trainer=ddp."
            )
        model: nn.Module = copy.deepcopy(student)
        if is_peft_model(model):
            model = cast(Any, model).merge_and_unload()  # the snapshot's names are the merged model's
        # eval mode for sampling; requires_grad stays as the student's: a sampler keeps copies of a trainable model's
        # weights in sync (VLLMSampler's engine, a bf16 decode copy) and never re-syncs a frozen one
        model.eval()
        self.model = model
        self._parameters = dict(model.state_dict(keep_vars=True))
        self.sampler.start({"student": model}, max_model_len=max_model_len)

    def end_rollout(self) -> None:
        self.sampler.end_rollout()

    def load_weights(self, snapshot: WeightSnapshot) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for name, tensor in snapshot.tensors():
                target = self._parameters.get(name)
                if target is None:
                    raise KeyError(f"The rollout engine's copy of the student has no weight named {name!r}.")
                target.copy_(tensor)
        self.sampler.weights_updated()
        return time.perf_counter() - started

    def sample(
        self, prompts: torch.Tensor, prompt_attention_mask: torch.Tensor, *, seed: int, vision: VisionRows | None = None
    ) -> dict[str, Any]:
        assert self.model is not None, "start the engine first"
        return self.sampler.sample(self.model, prompts, prompt_attention_mask, seed=seed, vision=vision)

    def bind_teachers(self, sources: Mapping[str, Any]) -> None:
        self.sampler.bind_teachers(sources)  # speculative KD's sampler verifies with the in-process teacher

    def close(self) -> None:
        self.sampler.close()
        self.model, self._parameters = None, {}

    def last_stats(self) -> dict[str, float]:
        return self.sampler.last_stats()

    def sampled_logprobs_problem(self) -> str | None:
        return self.sampler.sampled_logprobs_problem()
