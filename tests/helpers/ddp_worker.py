"""Two-process DDP runs on CPU (gloo) for tests/training/test_ddp.py; rank 0 writes the measurements to
<out>/result.json.

    python tests/helpers/ddp_worker.py <out_dir>

Lightning's DDP launcher starts rank 1 by re-running this script; everything below runs on both ranks. Four fits
of ``GKDModule`` (tiny random Qwen2 student and teacher, toy addition rows), each recording per rank what it
trained on:

1. ``parity_equal``: lmbda = 0 (dataset completions, no sampling), SGD, 3 steps, 4 rows per rank, on rows whose
   completions all have the same number of tokens. Rank 0 replays it in one process twice: with the mean of the
   two ranks' losses on their recorded batches (what plain DDP gradient averaging would optimize), and with the
   real single-process loader at batch_size = 8 (the "doubled batch": the same 8 rows per step, one token mean).
2. ``parity_uneven``: the same on natural rows, where the ranks' completion token counts differ; with the default
   loss_normalization="step" DDP trains on the token mean over both ranks, so the doubled batch matches and the
   half-batch-mean replay (the mean of per-rank means) does not.
3. ``flips``: lmbda = 0.5, 8 steps: every ``choose_source`` result per rank.
4. ``grouped``: steps_per_generation = 2, lmbda = 1, 4 steps: sampling calls per rank and the prompts trained on.
5. ``accumulated``: natural rows, 2 accumulated micro-batches of 2 rows per rank and step, against one process on
   8 rows per step.
6. ``cross_tokenizer``: ``parity_uneven`` with a teacher whose tokenizer differs (a BPE over the toy rows): the loss
   is a mean over byte-aligned groups and the step's normaliser counts groups over both ranks, so DDP's weights match
   one process on the doubled batch.
7. ``tools``: lmbda = 1 with tools (scripted turns, real tool calls on each rank for its own rows), 2 steps, against
   one process rolling out the doubled batch.
8. ``hidden_server``: ``parity_uneven`` with the teacher served as final hidden states (one fake vLLM pooling server
   that tests/training/test_ddp.py starts, both ranks its clients; the head read from the teacher's folder), against
   one process with the teacher in process on the doubled batch.
9. ``asynchronous``: lmbda = 1 with asynchronous rollouts (max_staleness 1, the in-process engine), 4 steps: each
   rank's producer samples that rank's rows, in the loader's order, one step behind.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_gkd import ChatDataModule, GKDModule
from lightning_gkd.data.loader import rank_groups
from lightning_gkd.data.tokenizer import TOOLS_CHATML_TEMPLATE, build_chatml_bpe_tokenizer, build_chatml_tokenizer
from lightning_gkd.toy import addition_rows, tool_rows
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm
from lightning_gkd.toy.tools import TOOLS
from tests.helpers.fitting import small_trainer
from tests.helpers.scripted_sampler import ScriptedSampler

KEYS = ("input_ids", "attention_mask", "labels")
LR, MAX_LENGTH, SEED = 1.0, 64, 0


def prompt_tokens(ids: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """Per row, the token ids where ``keep`` is true (left padding and completions dropped)."""
    rows = zip(ids.tolist(), keep.tolist(), strict=True)
    return [[int(t) for t, k in zip(row, mask, strict=True) if k] for row, mask in rows]


def trained_prompts(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Prompt ids of each row of a training batch: attended tokens without a label (completion padding after EOS
    is not attended, so it is not counted)."""
    return prompt_tokens(batch["input_ids"], (batch["attention_mask"] == 1) & (batch["labels"] == -100))


class Recorded(GKDModule):
    """GKDModule that records, on its rank, every coin flip, every sampling call's prompts, and every trained batch
    with its loss."""

    def __init__(self, *args, **kwargs) -> None:
        # a float32 teacher: the equalities compare batch splits, and bf16 products' rounding depends on the split
        kwargs["training"] = {"frozen_dtype": "float32", **(kwargs.get("training") or {})}
        super().__init__(*args, **kwargs)
        self.flips: list[list] = []
        self.sampled: list[list[list[int]]] = []
        self.trained: list[dict] = []
        self._current: dict | None = None

    def _training(self) -> bool:
        return self._trainer is not None and self.trainer.training

    def choose_source(self, batch_idx):
        source = super().choose_source(batch_idx)
        if self._training():
            self.flips.append([self.global_step, batch_idx, source])
        return source

    def sample_batch(self, model, batch, seed):
        self.sampled.append(prompt_tokens(batch["prompts"], batch["prompt_attention_mask"] == 1))
        return super().sample_batch(model, batch, seed)

    def training_batch(self, batch, batch_idx):
        source, batch = super().training_batch(batch, batch_idx)
        self._current = {"step": self.global_step, "source": source, **{k: batch[k].detach().cpu() for k in KEYS}}
        return source, batch

    def distillation_loss(self, batch):
        out = super().distillation_loss(batch)
        if self._training() and self._current is not None:
            self.trained.append({**self._current, "loss": out.loss.item()})
            self._current = None
        return out


SGD = partial(torch.optim.SGD, lr=LR)


def make_module(tokenizer, *, lmbda: float, **kwargs) -> Recorded:
    return Recorded(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1),
        tokenizer,
        lmbda=lmbda,
        divergence={"beta": 0.5},
        training={"optimizer": SGD, "seed": SEED},
        **kwargs,
    )


def fit(
    out: Path, module: Recorded, data: ChatDataModule, steps: int, accumulate: int = 1, strategy: Any = "ddp"
) -> L.Trainer:
    trainer = small_trainer(out, devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(module, datamodule=data)
    return trainer


def gather(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def flat_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def expected_prompts(
    rows: list[dict], data: ChatDataModule, *, group_size: int, groups: int, rank: int
) -> list[list[int]]:
    """Prompt ids of the rows ``rank_groups`` gives ``rank`` in its first ``groups`` groups of epoch 0."""
    picked = rank_groups(len(rows), group_size=group_size, epoch=0, seed=SEED, shuffle=True, rank=rank, world_size=2)[
        :groups
    ]
    batch = data.collator([rows[i] for group in picked for i in group])
    return prompt_tokens(batch["prompts"], batch["prompt_attention_mask"] == 1)


def equal_length_rows(count: int) -> list[dict]:
    """``count`` toy rows whose completions all have the same number of tokens (3-digit answers)."""
    return [row for row in addition_rows("train", 200) if len(row["answer"]) == 3][:count]


def doubled_reference(tokenizer, rows: list[dict], batch_size: int, steps: int, make=None):
    """One process, the real loader at ``batch_size`` rows per step, SGD on the token-mean loss: per-step losses
    and prompts, the first step's token count, and the final weights. ``make``: the module (default
    ``make_module(tokenizer, lmbda=0.0)``)."""
    data = ChatDataModule(tokenizer, rows, batch_size=batch_size, max_length=MAX_LENGTH, seed=SEED)
    ref = make() if make is not None else make_module(tokenizer, lmbda=0.0)
    ref.check_datamodule(data)  # a cross-tokenizer teacher: the batches carry the prompt messages
    opt = torch.optim.SGD([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    losses, prompts, step0_tokens = [], [], None
    for step, batch in enumerate(itertools.islice(data.train_dataloader(), steps)):
        keys = (*KEYS, "prompt_messages") if "prompt_messages" in batch else KEYS
        loss = ref.distillation_loss({k: batch[k] for k in keys}).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        prompts.append(prompt_tokens(batch["prompts"], batch["prompt_attention_mask"] == 1))
        if step == 0:
            step0_tokens = int((batch["labels"] != -100).sum())
    return losses, prompts, step0_tokens, flat_state(ref.student)


# -- 1, 2: loss and weights vs one process --------------------------------------------------------------------
def parity(out: Path, tokenizer, rows: list[dict], steps: int = 3, per_rank: int = 4) -> dict | None:
    data = ChatDataModule(tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED)
    module = make_module(tokenizer, lmbda=0.0)
    fit(out, module, data, steps)
    rank = dist.get_rank()
    final = flat_state(module.student)
    by_rank = gather(module.trained)
    finals = gather(final)
    sources = gather([row["source"] for row in module.trained])
    prompts = gather([p for row in module.trained for p in trained_prompts(row)])  # [rank][row], in step order
    expected = [expected_prompts(rows, data, group_size=per_rank, groups=steps, rank=r) for r in (0, 1)]
    if rank != 0:
        return None

    ddp_losses = [[row["loss"] for row in part] for part in by_rank]
    tokens = [[int((row["labels"] != -100).sum()) for row in part] for part in by_rank]

    # (a) the mean of the two ranks' losses, in one process, on the batches each rank trained on
    ref = make_module(tokenizer, lmbda=0.0)
    opt = torch.optim.SGD([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    half_mean = []
    for step in range(steps):
        loss = torch.stack([ref.distillation_loss({k: by_rank[r][step][k] for k in KEYS}).loss for r in (0, 1)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        half_mean.append(loss.item())
    half_mean_state = flat_state(ref.student)

    # (b) the doubled batch: one process, the real loader at batch_size = 2 * per_rank (same 8 rows per step)
    doubled, doubled_prompts, doubled_step0_tokens, doubled_state = doubled_reference(
        tokenizer, rows, 2 * per_rank, steps
    )

    return {
        "ddp_losses": ddp_losses,  # [rank][step]
        "ddp_mean_losses": [(a + b) / 2 for a, b in zip(*ddp_losses, strict=True)],
        # the step's token mean over both ranks: what loss_normalization="step" trains on and logs
        "ddp_token_mean_losses": [
            (a * ta + b * tb) / (ta + tb) for a, b, ta, tb in zip(*ddp_losses, *tokens, strict=True)
        ],
        "completion_tokens": tokens,  # [rank][step]
        "sources": sources,
        "half_mean_losses": half_mean,
        "doubled_losses": doubled,
        "doubled_step0_tokens": doubled_step0_tokens,
        "weights_rank0_vs_rank1": max_abs_diff(finals[0], finals[1]),
        "weights_vs_half_mean": max_abs_diff(final, half_mean_state),
        "weights_vs_doubled": max_abs_diff(final, doubled_state),
        "weights_changed": max_abs_diff(final, flat_state(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0))),
        "prompts_match_rank_groups": [prompts[r] == expected[r] for r in (0, 1)],
        "doubled_rows_are_both_ranks": all(
            sorted(doubled_prompts[s])
            == sorted(prompts[0][s * per_rank : (s + 1) * per_rank] + prompts[1][s * per_rank : (s + 1) * per_rank])
            for s in range(steps)
        ),
    }


# -- 6: a teacher with another tokenizer -------------------------------------------------------------------------
def cross_tokenizer(out: Path, tokenizer, rows: list[dict], steps: int = 3, per_rank: int = 4) -> dict | None:
    corpus = [message["content"] for row in addition_rows("train", 200) for message in row["messages"]]
    teacher_tokenizer = build_chatml_bpe_tokenizer(corpus, merges=60)

    def make() -> Recorded:
        return Recorded(
            tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
            tiny_causal_lm(TINY_TEACHER, teacher_tokenizer, seed=1),
            tokenizer,
            teacher_tokenizer=teacher_tokenizer,
            lmbda=0.0,
            divergence={"beta": 0.5},
            training={"optimizer": SGD, "seed": SEED},
        )

    data = ChatDataModule(tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED)
    module = make()
    fit(out, module, data, steps)
    final = flat_state(module.student)
    finals = gather(final)
    if dist.get_rank() != 0:
        return None
    _, _, _, doubled_state = doubled_reference(tokenizer, rows, 2 * per_rank, steps, make=make)
    return {
        "cross_path": type(module.loss).__name__ == "CrossTokenizerDistillation",
        "weights_rank0_vs_rank1": max_abs_diff(finals[0], finals[1]),
        "weights_vs_doubled": max_abs_diff(final, doubled_state),
        "weights_changed": max_abs_diff(final, flat_state(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0))),
    }


# -- 3: the coin flip ------------------------------------------------------------------------------------------
def flips(out: Path, tokenizer, steps: int = 8) -> dict | None:
    rows = addition_rows("train", 32)
    data = ChatDataModule(tokenizer, rows, batch_size=2, max_length=MAX_LENGTH, seed=SEED)
    module = make_module(tokenizer, lmbda=0.5, sampling={"max_new_tokens": 4})
    fit(out, module, data, steps)
    per_rank = gather(module.flips)
    trained_sources = gather([row["source"] for row in module.trained])
    calls = gather(module.sampling_calls)
    if dist.get_rank() != 0:
        return None
    return {"flips": per_rank, "trained_sources": trained_sources, "sampling_calls": calls}


# -- 5: DDP with gradient accumulation on top ----------------------------------------------------------------------
def accumulated(out: Path, tokenizer, rows: list[dict], steps: int = 2, per_rank: int = 2, k: int = 2) -> dict | None:
    """2 ranks x ``k`` accumulated micro-batches of ``per_rank`` rows per optimizer step, natural (uneven) rows,
    against one process on ``2 * k * per_rank`` rows per step."""
    data = ChatDataModule(tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED)
    module = make_module(tokenizer, lmbda=0.0)
    fit(out, module, data, steps, accumulate=k)
    final = flat_state(module.student)
    trained = gather([(row["step"], row["loss"], int((row["labels"] != -100).sum())) for row in module.trained])
    if dist.get_rank() != 0:
        return None
    doubled, _, _, doubled_state = doubled_reference(tokenizer, rows, 2 * k * per_rank, steps)
    rows_by_step = [[row for part in trained for row in part if row[0] == step] for step in range(steps)]
    return {
        "micro_batches_per_step": [len(step_rows) for step_rows in rows_by_step],
        "micro_batch_tokens": [[n for _, _, n in step_rows] for step_rows in rows_by_step],
        "token_mean_losses": [
            sum(loss * n for _, loss, n in step_rows) / sum(n for *_, n in step_rows) for step_rows in rows_by_step
        ],
        "doubled_losses": doubled,
        "weights_vs_doubled": max_abs_diff(final, doubled_state),
        "weights_changed": max_abs_diff(final, flat_state(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0))),
    }


# -- 4: grouped generation -------------------------------------------------------------------------------------
def grouped(out: Path, tokenizer, steps: int = 4, k: int = 2, per_rank: int = 2) -> dict | None:
    rows = addition_rows("train", 32)
    data = ChatDataModule(
        tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED, steps_per_generation=k
    )
    module = make_module(tokenizer, lmbda=1.0, sampling={"max_new_tokens": 4})
    fit(out, module, data, steps)
    rank = dist.get_rank()
    report = {
        "sampling_calls": module.sampling_calls,
        "sampled": module.sampled,  # [call][row] prompt ids
        "trained": [trained_prompts(row) for row in module.trained],  # [step][row]
        "sources": [row["source"] for row in module.trained],
        "steps": [row["step"] for row in module.trained],
        "expected": expected_prompts(rows, data, group_size=k * per_rank, groups=steps // k, rank=rank),
    }
    parts = gather(report)
    return {"ranks": parts, "steps": steps, "k": k} if rank == 0 else None


# -- 7: on-policy steps with tools (multi-turn rollouts), each rank rolling out its own rows ----------------------
def tools(out: Path, steps: int = 2, per_rank: int = 2) -> dict | None:
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = TOOLS_CHATML_TEMPLATE
    rows = tool_rows("train", 16)
    script = {
        row["messages"][0]["content"]: [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        for row in rows
    }

    def make() -> Recorded:
        return make_module(
            tokenizer,
            lmbda=1.0,
            sampling={"sampler": ScriptedSampler(tokenizer, script), "max_new_tokens": 64},
            rollout={"tools": list(TOOLS), "tool_state_columns": ["facts"]},
        )

    def data(batch_size: int) -> ChatDataModule:
        return ChatDataModule(tokenizer, rows, batch_size=batch_size, max_length=400, seed=SEED, assistant_turns="all")

    module = make()
    fit(out, module, data(per_rank), steps)
    final = flat_state(module.student)
    tokens = gather([int((row["labels"] != -100).sum()) for row in module.trained])
    if dist.get_rank() != 0:
        return None
    ref, ref_data = make(), data(2 * per_rank)
    ref.check_datamodule(ref_data)
    opt = torch.optim.SGD([p for p in ref.student.parameters() if p.requires_grad], lr=LR)
    for step, batch in enumerate(itertools.islice(ref_data.train_dataloader(), steps)):
        _, sampled = ref.training_batch(batch, step)
        loss = ref.distillation_loss(sampled).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "completion_tokens": tokens,  # [rank][step]: labels of whole transcripts
        "weights_vs_doubled": max_abs_diff(final, flat_state(ref.student)),
        "weights_changed": max_abs_diff(final, flat_state(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0))),
    }


# -- 8: one hidden-state server for both ranks ---------------------------------------------------------------------
def hidden_server(out: Path, tokenizer, rows: list[dict], steps: int = 3, per_rank: int = 4) -> dict | None:
    url, head = os.environ["LIGHTNING_GKD_TEST_HIDDEN_URL"], os.environ["LIGHTNING_GKD_TEST_HIDDEN_HEAD"]
    spec = {"kind": "server", "signal": "hidden", "url": url, "head": head, "dtype": "float32", "retries": 2}
    data = ChatDataModule(tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED)
    student = tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0)
    module = Recorded(
        student, spec, tokenizer, lmbda=0.0, divergence={"beta": 0.5}, training={"optimizer": SGD, "seed": SEED}
    )
    fit(out, module, data, steps)
    final = flat_state(module.student)
    finals = gather(final)
    if dist.get_rank() != 0:
        return None
    doubled = doubled_reference(tokenizer, rows, 2 * per_rank, steps)
    return {
        "weights_rank0_vs_rank1": max_abs_diff(finals[0], finals[1]),
        "weights_vs_doubled": max_abs_diff(final, doubled[3]),
        "weights_changed": max_abs_diff(final, flat_state(tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0))),
    }


# -- 9: asynchronous rollouts, one producer per rank -----------------------------------------------------------------
def asynchronous(out: Path, tokenizer, steps: int = 4, per_rank: int = 2) -> dict | None:
    from lightning_gkd.asynchronous import InProcessEngine

    rows = addition_rows("train", 32)
    data = ChatDataModule(tokenizer, rows, batch_size=per_rank, max_length=MAX_LENGTH, seed=SEED)
    module = make_module(
        tokenizer,
        lmbda=1.0,
        sampling={"max_new_tokens": 4},
        asynchronous={"max_staleness": 1, "engine": InProcessEngine},
    )
    fit(out, module, data, steps)
    rank = dist.get_rank()
    report = {
        "trained": [trained_prompts(row) for row in module.trained],  # [step][row]
        "sources": [row["source"] for row in module.trained],
        "staleness": {str(k): v for k, v in module.staleness.figures().items()},
        "expected": expected_prompts(rows, data, group_size=per_rank, groups=steps, rank=rank),
    }
    parts = gather(report)
    return {"ranks": parts, "steps": steps} if rank == 0 else None


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    tokenizer = build_chatml_tokenizer()
    L.seed_everything(0)
    result: dict = {}
    result["parity_equal"] = parity(out / "parity_equal", tokenizer, equal_length_rows(24))
    result["parity_uneven"] = parity(out / "parity_uneven", tokenizer, addition_rows("train", 24))
    result["flips"] = flips(out / "flips", tokenizer)
    result["grouped"] = grouped(out / "grouped", tokenizer)
    result["accumulated"] = accumulated(out / "accumulated", tokenizer, addition_rows("train", 24))
    result["cross_tokenizer"] = cross_tokenizer(out / "cross_tokenizer", tokenizer, addition_rows("train", 24))
    result["tools"] = tools(out / "tools")
    result["hidden_server"] = hidden_server(out / "hidden_server", tokenizer, addition_rows("train", 24))
    result["asynchronous"] = asynchronous(out / "asynchronous", tokenizer)
    result["world_size"] = dist.get_world_size()
    result["backend"] = dist.get_backend()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
