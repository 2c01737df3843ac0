"""The on-policy base GKD and OPD share: a trainable student, the teachers of a teacher plan, a sampling engine and
its lifecycle, the λ coin (student samples, teacher samples, or the dataset completions) and grouped generation. A
method on it supplies its loss objects: ``training_loss`` for what a step trains on, ``completion_loss`` for
validation's dataset completions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal, cast

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from transformers import PreTrainedTokenizerBase

from lightning_gkd.asynchronous import AsyncSettings, RolloutEngine, RolloutProducer, StalenessLedger, WeightSnapshot
from lightning_gkd.data.loader import (
    UPCOMING,
    GenerationGroup,
    group_slot,
    micro_batch_rows,
    shuffled_micro_batches,
)
from lightning_gkd.data.tokenizer import load_tokenizer
from lightning_gkd.evaluation.metrics import reference_texts
from lightning_gkd.evaluation.settings import ValidationSettings
from lightning_gkd.losses.base import STUDENT_SAMPLES, DistillationLoss, LeanPath, LossOutput
from lightning_gkd.losses.plan import divergence_loss
from lightning_gkd.losses.settings import DivergenceSettings, check_range
from lightning_gkd.methods.base import CausalLMModule, Group, settings_group
from lightning_gkd.models.loading import ModelSource
from lightning_gkd.ops.constants import IGNORE_INDEX
from lightning_gkd.ops.decoding.sampling import eos_ids
from lightning_gkd.ops.hf.forward import resolve_eos_token_id, resolve_pad_token_id
from lightning_gkd.rollouts import MultiTurnRollout, RolloutSettings, RolloutStats, build_rollout, rollout_transcripts
from lightning_gkd.rollouts.evaluate import final_answers, greedy_turn
from lightning_gkd.samplers import Sampler, SamplingSettings
from lightning_gkd.samplers.base import check_sampler_images
from lightning_gkd.teachers import LocalTeacher, TeacherUnavailable
from lightning_gkd.teachers.spec import TeacherPlan, build_teachers
from lightning_gkd.training.sampler_shutdown import SamplerShutdown
from lightning_gkd.training.settings import TrainingSettings
from lightning_gkd.training.teacher_outage import BEFORE_UPDATE, IN_VALIDATION, TeacherOutage, stop_ranks_together

Source = Literal["dataset", "student", "teacher"]  # where a batch's completions come from
# salts that keep the coin flip's, the sampler's and the group shuffle's random streams apart
_COIN, _SAMPLE, _SHUFFLE = 0, 1, 2
#: Constructor arguments a checkpoint does not record: the asynchronous group's engine is an object, and its staleness
#: means nothing without it, so a module loaded from a checkpoint samples synchronously unless given them again.
ENGINE_ARGUMENTS = ("asynchronous",)
#: With tools and no ``max_transcript_tokens``, a serving engine is sized for transcripts this many times
#: ``data.max_length`` (plus a turn's ``max_new_tokens``).
ROLLOUT_CONTEXT_FACTOR = 4


def rollout_settings_for_teacher(rollout: RolloutSettings, *, same_vocab: bool) -> RolloutSettings:
    """The rollout settings a method runs with its teacher: ``rollout`` itself for a teacher of the student's
    tokenizer; for one of another tokenizer, every turn its own row (``split_turns``), since the cross-tokenizer
    losses align one completion per row, the teacher reading each turn's context through its own chat template.
    ValueError, before any model loads, for what that cannot align: reasoning kept out of the trained tokens or
    capped (a turn's labels would not be one run of the text the teacher scores)."""
    if same_vocab or not rollout.enabled:
        return rollout
    if rollout.reasoning != "keep" or rollout.max_reasoning_tokens is not None:
        raise ValueError(
            f"Tools or an environment with a teacher of another tokenizer score each student turn as one text, "
            f"but rollout.reasoning={rollout.reasoning!r} and rollout.max_reasoning_tokens="
            f"{rollout.max_reasoning_tokens!r} leave tokens of a turn untrained (dropped reasoning, or the closing "
            "marker a cap writes for the student). Use rollout.reasoning=keep and max_reasoning_tokens=null with "
            "this teacher, or a teacher with the student's tokenizer."
        )
    return replace(rollout, split_turns=True)


class OnPolicyModule(CausalLMModule):
    """A student trained on completions that come, per step, from the student itself (with probability ``lmbda``),
    the teacher (``seq_kd``) or the dataset, against the teachers of ``teachers`` (a ``TeacherPlan``).

    The coin flip and the sampler's seed are functions of (``training.seed``, global step, batch index), so every rank
    flips the same coin and a resumed run repeats them. Sampling (``sampling``: ``SamplingSettings``) uses
    ``temperature``, ``top_k``, ``top_p`` and at most ``max_new_tokens`` new tokens, always with the KV cache, through
    ``sampling.sampler`` (our KV-cache decoder unless one is given; a factory, Hydra ``sampler=hf|vllm|skd``, is called
    with the tokenizer and those options); a served teacher's samples come from its server. ``divergence``
    (``DivergenceSettings``): the generalized JSD of the method's losses and how it is computed.

    Grouped generation (``ChatDataModule(steps_per_generation=k)``): the coin is flipped once per group of ``k``
    micro-batches; when it says sample, one sampling call covers the group's ``k * batch_size`` prompts, the result
    is shuffled (seeded like the sampler) and cut into ``k`` micro-batches, one training step each. The pending
    micro-batches are saved in checkpoints, so a run resumed in the middle of a group trains on the same samples.

    A subclass sets ``self.loss`` (its training loss object) after calling ``__init__`` and defines
    ``training_loss`` and ``completion_loss``; ``loss_objects`` lists every loss object it calls (their
    ``check_datamodule`` and ``close`` run with the fit).

    Multi-turn rollouts (``lightning_gkd.rollouts``; ``rollout``: ``RolloutSettings``): with ``tools`` (callables or
    import paths) or an ``environment``, a sampled completion is a whole transcript: the model writes a turn, the
    tools (or the environment) answer, until it answers without a call, ``max_tool_calling_iterations`` replies have
    been made or the transcript reaches ``max_transcript_tokens``. Only the model's tokens are labels. Each call gets
    ``tool_timeout`` seconds and the row's ``tool_state_columns`` as ``row_state()``; ``tool_parser`` reads calls
    (default: the tokenizer's response schema, else ``<tool_call>{json}</tool_call>``). Prompts end before each
    row's first assistant turn; validation's generation metrics score the final answer of greedy rollouts.

    Each group argument takes the settings, a mapping of overrides applied onto the method's defaults
    (``default_sampling``, ``default_divergence``, ``default_rollout``), or None for those."""

    frozen_names = ("teacher",)
    model_role = "student"
    loss: DistillationLoss
    sampler: Sampler
    default_sampling: ClassVar[SamplingSettings] = SamplingSettings()
    default_divergence: ClassVar[DivergenceSettings] = DivergenceSettings()
    default_rollout: ClassVar[RolloutSettings] = RolloutSettings()
    default_asynchronous: ClassVar[AsyncSettings] = AsyncSettings()

    def __init__(
        self,
        student: ModelSource,
        teachers: TeacherPlan,
        tokenizer: PreTrainedTokenizerBase | str,
        *,
        lmbda: float,
        seq_kd: bool,
        sampling: Group[SamplingSettings] = None,
        divergence: Group[DivergenceSettings] = None,
        rollout: Group[RolloutSettings] = None,
        asynchronous: Group[AsyncSettings] = None,
        training: Group[TrainingSettings] = None,
        validation: Group[ValidationSettings] = None,
        same_vocab: bool = True,
    ) -> None:
        # before any model loads
        sampling = settings_group(sampling, self.default_sampling, "sampling")
        divergence = settings_group(divergence, self.default_divergence, "divergence")
        rollout = settings_group(rollout, self.default_rollout, "rollout")
        asynchronous = settings_group(asynchronous, self.default_asynchronous, "asynchronous")
        sampling.check_teachers(teachers)
        check_range("lmbda", lmbda, 0.0, 1.0)
        tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        rollout = rollout_settings_for_teacher(rollout, same_vocab=same_vocab)
        if rollout.enabled:  # the template can take them
            build_rollout(tokenizer, rollout, eos_token_ids=[])
        super().__init__(student, tokenizer, training=training, validation=validation)
        #: How completions are sampled (``SamplingSettings``; the engine itself: ``sampler``).
        self.sampling = sampling
        #: The generalized JSD of the method's losses (``DivergenceSettings``).
        self.divergence = divergence
        #: Multi-turn rollouts' settings (``RolloutSettings``; the rollout itself: ``rollout``).
        self.rollout_settings = rollout
        #: Asynchronous rollouts' settings (``AsyncSettings``; the engine: ``rollout_engine``).
        self.asynchronous = asynchronous
        #: The producer's engine (None: synchronous sampling through ``sampler``).
        self.rollout_engine: RolloutEngine | None = (
            asynchronous.build(tokenizer, **sampling.options()) if asynchronous.enabled else None
        )
        #: The running producer (during a fit with ``rollout_engine``), and what the trainer did with its samples.
        self.producer: RolloutProducer | None = None
        self.staleness = StalenessLedger(asynchronous.max_staleness)
        self._planned: dict[tuple[int, int], Source] = {}  # (epoch, batch index) -> source, decided ahead
        self._published_version = -1
        self._engine_max_model_len: int | None = None
        #: Where the losses read each teacher's signal (``lightning_gkd.teachers``), by name (``""``: the only one).
        self.teacher_sources, models = build_teachers(
            teachers,
            lambda source, role: self.load_frozen(source, role=role),
            self.student,
            self.tokenizer,
            same_vocab=same_vocab,
        )
        #: The in-process teacher model (an ``nn.ModuleDict`` by name under ``multi``; None without one).
        self.teacher: torch.nn.Module | None = torch.nn.ModuleDict(models) if teachers.routed else models.get("")
        if teachers.routed and any(role.startswith("teacher.") for role in self._frozen_dtype_open):
            self._frozen_dtype_open.add("teacher")
        #: The only teacher's source (None under ``multi``: see ``teacher_sources``).
        self.teacher_source: Any = None if teachers.routed else self.teacher_sources[""]
        self.teacher_column = teachers.column  # the rows' routing column under ``multi``
        self._same_vocab = same_vocab  # False: a teacher with another tokenizer (cross-tokenizer losses)
        #: Hidden states or full logits for the in-process teachers' losses (``LeanPath``: the fallback policy).
        self.lean_path = LeanPath(divergence.lean_loss)
        #: seq_kd with a served teacher: the server writes the teacher's completions (None: ``sampler`` does).
        self.teacher_sampler: Sampler | None = None
        if seq_kd and self.teacher is None:
            from lightning_gkd.teachers.server import ServerSampler

            self.teacher_sampler = ServerSampler(
                cast(Any, self.teacher_source),
                eos_token_id=resolve_eos_token_id(self.student, self.tokenizer),
                pad_token_id=resolve_pad_token_id(self.tokenizer),
                **sampling.options(),
            )
        #: How completions are sampled (``lightning_gkd.samplers``).
        self.sampler = sampling.build(self.tokenizer)
        self.sampler.bind_teachers(self.teacher_sources)  # a sampler that consults the teacher (speculative KD)
        if self.rollout_engine is not None:
            self.rollout_engine.bind_teachers(self.teacher_sources)
        self.lmbda, self.seq_kd = lmbda, seq_kd
        self._batches = self._on_policy_batches = 0
        self._group: GenerationGroup | None = None
        self.sampling_calls = 0  # sampling calls in this process's current fit
        #: Multi-turn rollouts with tools or an environment (None: one completion per prompt).
        self.rollout: MultiTurnRollout | None = build_rollout(
            self.tokenizer, rollout, eos_token_ids=eos_ids(resolve_eos_token_id(self.student, self.tokenizer))
        )

    @property
    def student(self) -> torch.nn.Module:
        """The trainable model (``self.model``)."""
        return self.model

    def completing_teacher(self) -> torch.nn.Module | None:
        """The teacher model that can complete the student's prompts in this process (one local teacher with the
        student's tokenizer), else None: a served, cached or routed teacher, or one with another tokenizer."""
        return self.teacher if self._same_vocab and isinstance(self.teacher_source, LocalTeacher) else None

    # -- the method's losses ----------------------------------------------------------------------------------------
    def divergence_loss(self) -> DistillationLoss:
        """GKD's loss against this run's teachers (``losses.plan.divergence_loss``): ``divergence``'s generalized JSD
        over each in-process teacher's full distributions, its ``sparse_loss`` over each sparse one's top-k."""
        return divergence_loss(self.teacher_sources, self.teacher_column, self.divergence, lean=self.lean_path)

    def settings_groups(self) -> dict[str, Any]:
        return {
            **super().settings_groups(),
            "sampling": self.sampling,
            "divergence": self.divergence,
            "rollout": self.rollout_settings,
        }

    def training_loss(self, batch: dict[str, Any]) -> LossOutput:
        """The loss a training step takes on ``batch`` (dataset completions or samples)."""
        raise NotImplementedError

    def loss_objects(self) -> list[DistillationLoss]:
        """Every loss object the method calls (their ``check_datamodule`` and ``close`` run with the fit)."""
        return [self.loss]

    def completion_requirement(self) -> str | None:
        if self.lmbda >= 1 or self.seq_kd:
            return None
        return (
            f"{type(self).__name__}(lmbda={self.lmbda}, seq_kd=False) trains on the dataset completions in about "
            f"{1 - self.lmbda:.0%} of the steps. End every training row with an assistant message, or train "
            "without dataset completions: lmbda=1.0 (student samples only; Hydra: method.lmbda=1.0) or "
            "seq_kd=True (teacher samples; method.seq_kd=true)."
        )

    # -- the sampling engine's lifecycle (a serving engine such as VLLMSampler; KVCacheSampler's do nothing) ------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        # the engines' length, before callbacks (held-out evaluation) first use them
        max_length = getattr(getattr(self._trainer, "datamodule", None), "max_length", None)
        if max_length and self.rollout is not None:  # a transcript grows past the prompt, turn by turn
            max_length = self.rollout.max_transcript_tokens or ROLLOUT_CONTEXT_FACTOR * max_length
        longest = max(self.sampling.max_new_tokens, self.validation.max_new_tokens)
        self.sampler.start({}, max_model_len=max_length + longest if max_length else None)
        self._engine_max_model_len = max_length + self.sampling.max_new_tokens if max_length else None

    def on_fit_start(self) -> None:
        super().on_fit_start()
        # engines start from the weights as fitting starts (after a checkpoint restore)
        self.sampler.start(
            {"student": self.student, **({"teacher": self.teacher} if self.seq_kd and self.teacher else {})}
        )
        if self.rollout_engine is not None and self.producer is None:
            self.rollout_engine.start(self.student, max_model_len=self._engine_max_model_len)
            self.producer = RolloutProducer(self.rollout_engine, self._produce)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._batches = self._on_policy_batches = self.sampling_calls = 0
        self._planned.clear()
        self.staleness = StalenessLedger(self.asynchronous.max_staleness)
        if self.producer is not None:  # the weights training starts from (a checkpoint's: its step is known now)
            self._publish_weights()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.producer is not None and self.global_step != self._published_version:
            self._publish_weights()  # an optimizer step changed the student: later jobs sample with its new weights

    def _publish_weights(self) -> None:
        assert self.producer is not None and self.rollout_engine is not None
        snapshot = WeightSnapshot.take(self.student, self.global_step, shared=self.rollout_engine.remote)
        self.staleness.snapshot_seconds += snapshot.seconds
        self._published_version = snapshot.version
        self.producer.publish(snapshot)

    def close_engines(self) -> None:
        """Stop the sampler's engines and the producer (its thread and engine); they start again with the next fit."""
        self.sampler.close()
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.close()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        self.sampler.weights_updated()  # the step about to run changes the student: its engine re-syncs when due

    def configure_callbacks(self) -> list[L.Callback]:
        # an interrupted fit calls no module hook: this callback stops the engines then (SIGTERM, errors)
        callbacks: list[L.Callback] = [*super().configure_callbacks(), SamplerShutdown(self.close_engines)]
        if self.teacher_can_be_unavailable:
            callbacks.append(TeacherOutage())  # a teacher server that stays down: checkpoint, resume hint
        return callbacks

    @property
    def teacher_can_be_unavailable(self) -> bool:
        """Whether a teacher (a server) or the rollout engine lives outside the process, so a step can raise
        ``TeacherUnavailable``."""
        remote_engine = self.rollout_engine is not None and self.rollout_engine.remote
        return remote_engine or any(not isinstance(source, LocalTeacher) for source in self.teacher_sources.values())

    def stop_ranks_together(self, failure: TeacherUnavailable | None, *, where: str = BEFORE_UPDATE) -> None:
        """With a served teacher under several processes: every rank raises ``TeacherUnavailable`` when any rank's
        teacher failed in this step or validation batch (``training.teacher_outage.stop_ranks_together``; one small
        all-reduce)."""
        if self.teacher_can_be_unavailable:
            stop_ranks_together(failure, self.trainer, where=where)

    def validation_batch_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """``completion_loss(batch)``; with a served teacher under several processes the ranks agree after it, so a
        teacher that fails for one rank stops every rank together instead of leaving the others in validation's
        metric sync (``stop_ranks_together``)."""
        try:
            out = self.completion_loss(batch)
        except TeacherUnavailable as failure:
            self.stop_ranks_together(failure, where=IN_VALIDATION)
            raise
        self.stop_ranks_together(None, where=IN_VALIDATION)
        return out

    def check_datamodule(self, datamodule: L.LightningDataModule) -> None:
        super().check_datamodule(datamodule)
        if self.rollout is not None:
            use_rollouts = getattr(datamodule, "use_rollouts", None)
            if not callable(use_rollouts):
                raise ValueError(
                    f"Tools or an environment need a ChatDataModule (its prompts end before the first assistant turn "
                    f"and carry their messages), got {type(datamodule).__name__}."
                )
            use_rollouts(self.rollout.tools)
            max_length = getattr(datamodule, "max_length", None)
            context = self.rollout.max_transcript_tokens or (max_length and ROLLOUT_CONTEXT_FACTOR * max_length)
            for part in self.loss_objects():  # a teacher that renders contexts itself renders the schemas
                part.use_tools(self.rollout.tools, max_context_tokens=context or None)
            if self.rollout.state_columns:
                cast(Any, datamodule).carry_columns(self.rollout.state_columns)
        for part in (*self.loss_objects(), *self.teacher_sources.values()):
            part.check_datamodule(datamodule)  # a routing column, prompt messages; a cache made from these rows
        if self.rollout_engine is not None:
            look_ahead = getattr(datamodule, "look_ahead", None)
            if not callable(look_ahead):
                raise ValueError(
                    f"Asynchronous rollouts need a ChatDataModule (its batches announce the ones after them), got "
                    f"{type(datamodule).__name__}."
                )
            accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
            look_ahead(self.asynchronous.max_staleness * accumulate)
        if getattr(datamodule, "processor", None) is not None:  # rows with images
            check_sampler_images(self.sampler)
            if self.rollout_engine is not None and not self.rollout_engine.takes_images:
                raise ValueError(
                    f"{type(self.rollout_engine).__name__} does not sample from prompts with images: use producer=hf "
                    "(a copy of the student, sampled by the KV-cache decoder) for a vision-language student."
                )
            for source in self.teacher_sources.values():
                source.check_images(self.student)

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        engines = (self.sampler, self.teacher_sampler, *self.teacher_sources.values(), *self.loss_objects())
        for engine in {id(engine): engine for engine in engines if engine is not None}.values():
            engine.close()
        self.close_engines()

    # -- where a step's completions come from ----------------------------------------------------------------------
    def choose_source(self, batch_idx: int) -> Source:
        """The λ coin flip: "student" (on-policy) with probability lmbda, else "teacher" if seq_kd, else "dataset"."""
        coin = torch.Generator().manual_seed(self.step_seed(batch_idx, _COIN))
        if torch.rand((), generator=coin).item() < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "dataset"

    def sample_batch(self, model: torch.nn.Module | None, batch: dict[str, Any], seed: int) -> dict[str, Any]:
        """Replace the batch completions by ``model``'s samples for its prompts (through ``self.sampler``, or the
        teacher server's sampler for a served teacher's samples)."""
        self.sampling_calls += 1
        sampler = self.teacher_sampler if model is self.teacher and self.teacher_sampler is not None else self.sampler
        # a server's sampler ignores the model (its weights are the served teacher's)
        if self.rollout is None:
            sampled = sampler.sample(
                cast(torch.nn.Module, model),
                batch["prompts"],
                batch["prompt_attention_mask"],
                seed=seed,
                vision=batch.get("vision"),
            )
            self.log_sampler_stats(sampler, len(batch["prompts"]))
            return {**batch, **sampled}

        def sample_turn(ids: torch.Tensor, mask: torch.Tensor, turn_seed: int) -> dict[str, torch.Tensor]:
            return sampler.sample(cast(torch.nn.Module, model), ids, mask, seed=turn_seed)

        try:
            transcripts, stats = self.rollout.run(sample_turn, batch, seed)
        finally:
            sampler.end_rollout()  # the KV caches kept across its turns
        self.check_rollout_rows(stats)
        self.log_sampler_stats(sampler, len(batch["prompts"]))  # the last turn's
        for name, value in stats.metrics().items():
            self.log(f"train/tools/{name}", value, batch_size=len(stats.turns))
        return transcripts

    def check_rollout_rows(self, stats: RolloutStats) -> None:
        """Raise when the method cannot train on transcripts split into several rows as ``stats`` counts them
        (``segments``); every split is fine here: each student token is a label in exactly one row."""

    def log_sampler_stats(self, sampler: Sampler, size: int) -> None:
        """The sampler's figures of its last call (``last_stats``, e.g. speculative KD's replacement rate) as
        ``train/sampler/<name>``."""
        for name, value in sampler.last_stats().items():
            self.log(f"train/sampler/{name}", value, batch_size=size)

    def collect_generations(self, batch: Mapping[str, torch.Tensor], dataloader_idx: int = 0) -> None:
        """With rollouts, validation's generation metrics score the final answers of greedy rollouts (through the
        sampler's ``greedy`` where it has one) against the rows' last assistant turns."""
        if self.rollout is None or not self.validation.metrics:
            super().collect_generations(batch, dataloader_idx)
            return
        turn = greedy_turn(self.student, self.tokenizer, self.validation.max_new_tokens, self.sampler)
        out, _ = self.rollout.run(turn, batch, seed=0)
        eos = resolve_eos_token_id(self.student, self.tokenizer)
        predictions = final_answers(rollout_transcripts(out))
        self.generation_scores.add(dataloader_idx, predictions, reference_texts(self.tokenizer, batch, eos))

    def _sampler_model(self, source: Source) -> torch.nn.Module | None:
        return self.student if source == "student" else self.teacher

    def training_batch(self, batch: dict[str, Any], batch_idx: int) -> tuple[Source, dict[str, Any]]:
        """The batch this step trains on and where its completions come from.

        A plain batch is its own group. A grouped micro-batch (``lightning_gkd.data.loader.group_slot``) uses its
        group's plan, made at the group's first micro-batch: the dataset micro-batch itself, or its share of the
        group's shuffled samples."""
        if self.producer is not None:
            return self.produced_batch(batch, batch_idx)
        slot = group_slot(batch)
        if slot is None:
            source = self.choose_source(batch_idx)
            if source != "dataset":
                batch = self.sample_batch(
                    self._sampler_model(source), batch, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank)
                )
            return source, batch
        if self._group is None or self._group.group_id != slot.group_id:
            self._group = self.plan_group(slot.group, slot.group_id, slot.micro_batch_size, batch_idx)
        if self._group.source == "dataset":
            return "dataset", batch
        return cast(Source, self._group.source), move_data_to_device(self._group.micro_batches[slot.step], self.device)

    # -- asynchronous rollouts ---------------------------------------------------------------------------------------
    def produced_batch(self, batch: dict[str, Any], batch_idx: int) -> tuple[Source, dict[str, Any]]:
        """Under asynchronous rollouts: flip the coins of this batch and of the batches it announces
        (``data.loader.UPCOMING``), hand those the student samples to the producer (with the weights as they are
        now), and take this batch's samples from it; a teacher's samples (``seq_kd``) are drawn now, as without it.
        Samples older than ``max_staleness`` steps (an accumulation window cut short at an epoch's end) are dropped,
        counted and drawn again with the current weights."""
        assert self.producer is not None
        upcoming = batch.get(UPCOMING, [])
        batch = {key: value for key, value in batch.items() if key != UPCOMING}
        for offset, later in [(0, batch), *upcoming]:
            key = (self.current_epoch, batch_idx + offset)
            if key not in self._planned:
                self._planned[key] = source = self.choose_source(key[1])
                if source == "student":
                    self.producer.submit(key, later, seed=self.step_seed(key[1], _SAMPLE, self.global_rank))
        key = (self.current_epoch, batch_idx)
        source = self._planned.pop(key)
        if source != "student":
            if source == "teacher":
                seed = self.step_seed(batch_idx, _SAMPLE, self.global_rank)
                batch = self.sample_batch(self._sampler_model(source), batch, seed=seed)
            return source, batch
        self.sampling_calls += 1
        produced, waited = self.producer.collect(key)
        self.staleness.trainer_idle_seconds += waited
        if not self.staleness.accept(produced, self.global_step):
            self.producer.submit(key, batch, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank))
            produced, waited = self.producer.collect(key)
            self.staleness.trainer_idle_seconds += waited
            self.staleness.accept(produced, self.global_step)
        size = len(batch["prompts"])
        self.log("train/async/staleness", float(self.global_step - produced.version), batch_size=size)
        self.log("train/async/sample_seconds", produced.seconds, batch_size=size)
        for name, value in {**self.staleness.figures(), **self.producer.figures()}.items():
            self.log(f"train/async/{name}", value, batch_size=size)
        for name, value in produced.figures.items():
            self.log(f"train/{name}", value, batch_size=size)
        return "student", move_data_to_device(produced.batch, self.device)

    def _produce(
        self, engine: RolloutEngine, batch: dict[str, Any], seed: int
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """One producer job (its thread): the student's samples of ``batch``'s prompts, or its multi-turn rollouts,
        and their figures (``sampler/<name>``, ``tools/<name>``) for the step that trains on them."""
        if self.rollout is None:
            sampled = engine.sample(
                batch["prompts"], batch["prompt_attention_mask"], seed=seed, vision=batch.get("vision")
            )
            figures = {f"sampler/{name}": value for name, value in engine.last_stats().items()}
            return {**batch, **sampled}, figures

        def sample_turn(ids: torch.Tensor, mask: torch.Tensor, turn_seed: int) -> dict[str, torch.Tensor]:
            return engine.sample(ids, mask, seed=turn_seed)

        try:
            transcripts, stats = self.rollout.run(sample_turn, batch, seed)
        finally:
            engine.end_rollout()
        self.check_rollout_rows(stats)
        figures = {f"sampler/{name}": value for name, value in engine.last_stats().items()}
        figures.update({f"tools/{name}": value for name, value in stats.metrics().items()})
        return transcripts, figures

    def plan_group(
        self, group: dict[str, torch.Tensor], group_id: list[int], micro_batch_size: int, batch_idx: int
    ) -> GenerationGroup:
        """Flip the group's coin; if it says sample, sample the whole group at once, shuffle and cut it."""
        source = self.choose_source(batch_idx)
        if source == "dataset":
            return GenerationGroup(group_id, source)
        sampled = self.sample_batch(
            self._sampler_model(source), group, seed=self.step_seed(batch_idx, _SAMPLE, self.global_rank)
        )
        seed = self.step_seed(batch_idx, _SHUFFLE, self.global_rank)
        parts = len(micro_batch_rows(len(group["prompts"]), micro_batch_size))  # the group's steps
        return GenerationGroup(group_id, source, shuffled_micro_batches(sampled, micro_batch_size, seed, parts=parts))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._group is not None:  # a resumed run continues the group with the same samples
            checkpoint["generation_group"] = self._group.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        plan = checkpoint.get("generation_group")
        self._group = GenerationGroup(**plan) if plan is not None else None

    # -- the step -------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        try:  # every call to a teacher server of this step: its samples (seq_kd) and its signal
            source, batch = self.training_batch(batch, batch_idx)
            batch = {**batch, STUDENT_SAMPLES: source == "student"}  # the losses' sample figures (losses.base)
            out = self.training_loss(batch)
        except TeacherUnavailable as failure:
            self.stop_ranks_together(failure)
            raise
        self.stop_ranks_together(None)  # before backward's gradient all-reduce, which a stopped rank never joins
        step_loss = self.finish_training_step(out, batch)
        if step_loss is None:
            return None
        self._batches += 1
        self._on_policy_batches += source == "student"
        size = batch["input_ids"].shape[0]
        completion_tokens = (batch["labels"] != IGNORE_INDEX).sum(dim=1).float()
        self.log("train/on_policy", float(source == "student"), batch_size=size)
        # the share of on-policy batches so far in this fit (train/on_policy is this batch's 0 or 1)
        self.log("train/on_policy_fraction", self._on_policy_batches / self._batches, prog_bar=True, batch_size=size)
        self.log("train/completion_length", completion_tokens.mean(), batch_size=size)
        return step_loss
