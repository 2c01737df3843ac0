"""Two-process DDP fits on CPU (gloo) for tests/training/test_stop_together.py: a failure on rank 1 only must stop
both ranks together, with one checkpoint, and a resume from it must train on. Every rank writes <out>/rank<r>.json:
how the failing fit ended (``stop``), how the resumed one did (``resume``), and (rank 0) what was saved.

    python tests/helpers/stop_together_ddp_worker.py validation_outage|nonfinite <out_dir>

Lightning starts rank 1 by re-running this script; both fits run in the same two processes (the process group
stays up between them). The process group's timeout is ``TIMEOUT_S``: a rank left waiting in a collective the other
never joins fails after it, so a missing agreement shows as a gloo timeout error, not a hang.

- ``validation_outage``: each rank serves the teacher (a tiny random Qwen2) from its own stand-in vLLM server; rank
  1's stops after its first validation batch at step ``AT`` (2 validation batches per rank every 2 steps), so its
  second batch's teacher call fails. The resume gets fresh servers.
- ``nonfinite``: an in-process teacher; rank 1's student logits are NaN in training step ``AT`` (a forward hook on
  its decoder). The resume runs without the hook.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.*

from helpers.launch import two_process_trainer  # noqa: E402
from lightning_gkd import ChatDataModule, GKDModule  # noqa: E402
from lightning_gkd.data.tokenizer import build_chatml_tokenizer  # noqa: E402
from lightning_gkd.testing.fake_vllm_server import FakeVLLMServer  # noqa: E402
from lightning_gkd.toy import addition_rows  # noqa: E402
from lightning_gkd.toy.tiny import TINY_STUDENT, TINY_TEACHER, tiny_causal_lm  # noqa: E402

AT, MAX_STEPS, TIMEOUT_S = 2, 4, 30
VALIDATION = {"limit_val_batches": 2, "val_check_interval": 2, "num_sanity_val_steps": 0}


class Validations(L.Callback):
    """Records [global step, validation batches] of each validation; with ``stop_on_rank1`` (a server) stops it on
    rank 1 after the first validation batch at step ``AT``."""

    def __init__(self, stop_on_rank1: FakeVLLMServer | None = None) -> None:
        self.seen: list[list[int]] = []
        self.server = stop_on_rank1

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append([trainer.global_step, 0])

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen[-1][1] += 1
        if self.server is not None and trainer.global_rank == 1 and trainer.global_step == AT:
            self.server.stop()


class PoisonRank1(L.Callback):
    """NaN in rank 1's student hidden states (so its logits) in training step ``AT``."""

    def __init__(self, student: torch.nn.Module) -> None:
        self.on = False
        self.handle = student.get_decoder().register_forward_hook(self.poison)

    def poison(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.on:
            output.last_hidden_state[0] = float("nan")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.on = trainer.global_rank == 1 and trainer.global_step == AT


def module_for(tokenizer: Any, teacher: Any) -> GKDModule:
    """The tiny student against ``teacher`` (a model or a server spec), dataset completions, SGD."""
    return GKDModule(
        tiny_causal_lm(TINY_STUDENT, tokenizer, seed=0),
        teacher,
        tokenizer,
        lmbda=0.0,
        divergence={"beta": 0.0},
        training={"optimizer": partial(torch.optim.SGD, lr=0.1)},
    )


def run_fit(trainer: L.Trainer, module: GKDModule, data: ChatDataModule, **fit_kwargs: Any) -> dict[str, Any]:
    """How ``trainer.fit`` ended on this rank: the error's type and message (None: finished), step, seconds."""
    started = time.perf_counter()
    try:
        trainer.fit(module, datamodule=data, **fit_kwargs)
        ended: dict[str, Any] = {"error": None, "message": None}
    except BaseException as error:  # what each rank saw: the point of the test
        ended = {"error": type(error).__name__, "message": str(error)}
    # the callback that saved (a StopCheckpoint: TeacherOutage, NonFiniteStop)
    saved = next((path for c in trainer.callbacks if (path := getattr(c, "saved_path", None))), None)  # type: ignore[attr-defined]
    return {
        **ended,
        "global_step": trainer.global_step,
        "seconds": time.perf_counter() - started,
        "saved": str(saved) if saved else None,
    }


def server_spec(server: FakeVLLMServer) -> dict[str, Any]:
    return {"kind": "server", "url": server.url, "top_k": 20, "retries": 1, "backoff": 0.01, "timeout": 10}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    tokenizer = build_chatml_tokenizer()
    teacher = tiny_causal_lm(TINY_TEACHER, tokenizer, seed=1)
    data = partial(
        ChatDataModule, tokenizer, addition_rows("train", 32), addition_rows("val", 8), batch_size=2, max_length=64
    )
    trainer_for = partial(two_process_trainer, kind="ddp", max_steps=MAX_STEPS, timeout_s=TIMEOUT_S, **VALIDATION)
    result: dict[str, Any] = {}
    if scenario == "validation_outage":
        with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as server:
            seen = Validations(stop_on_rank1=server)
            trainer = trainer_for(out, callbacks=[seen])
            result["stop"] = {
                **run_fit(trainer, module_for(tokenizer, server_spec(server)), data()),
                "validations": seen.seen,
            }
        saved = out / "checkpoints" / "last.ckpt"
        listing = sorted(str(p) for p in out.rglob("*.ckpt"))
        with FakeVLLMServer(teacher, tokenizer, max_model_len=128) as server:
            again = Validations()
            trainer = trainer_for(out / "resumed", callbacks=[again])
            module = module_for(tokenizer, server_spec(server))
            resumed = run_fit(trainer, module, data(), ckpt_path=saved, weights_only=True)
            result["resume"] = {**resumed, "validations": again.seen}
    elif scenario == "nonfinite":
        module = module_for(tokenizer, teacher)
        poison = PoisonRank1(module.student)
        trainer = trainer_for(out, callbacks=[poison], limit_val_batches=0)
        result["stop"] = run_fit(trainer, module, data())
        saved = out / "checkpoints" / "last.ckpt"
        listing = sorted(str(p) for p in out.rglob("*.ckpt"))
        poison.handle.remove()
        trainer = trainer_for(out / "resumed", limit_val_batches=0)
        result["resume"] = run_fit(trainer, module_for(tokenizer, teacher), data(), ckpt_path=saved, weights_only=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: validation_outage or nonfinite")
    rank = trainer.global_rank
    if rank == 0 and saved.exists():
        state = torch.load(saved, weights_only=True)
        result["saved_step"] = state["global_step"]
        result["saved_finite"] = all(
            bool(torch.isfinite(v).all()) for v in state["state_dict"].values() if v.is_floating_point()
        )
        result["checkpoints"] = listing
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
