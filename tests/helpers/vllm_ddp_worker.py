"""Two processes on CPU (gloo) with sampler=vllm, for tests/samplers/test_vllm.py; rank 0 writes <out>/result.json.

    python tests/helpers/vllm_ddp_worker.py <out_dir> ddp|fsdp

Lightning's launcher re-runs this script for rank 1. Each rank fits GKDModule with VLLMSampler (its own in-process
engine, vLLM's external launcher) under DDP, or FSDP2 (ModelParallelStrategy: the sync gathers the student's shards
one parameter at a time), for 4 steps at lmbda = 0.5 and records its coin flips, the prompts it sampled for, every
trained batch with its loss, its engine count and syncs, and, when training ends, its engine's greedy completions
of fixed prompts. Rank 0 then replays the steps in one process with the same initial weights: each rank's recorded
batch's loss computed there (no vLLM), the SGD update on the step's token mean over both ranks (what
loss_normalization="step" trains on), and our decoder's greedy completions with the trained full weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.ddp_worker import KEYS, LR, SGD, Recorded, fit, gather, prompt_tokens  # noqa: E402
from helpers.vllm_models import vllm_tiny  # noqa: E402
from lightning_gkd import ChatDataModule  # noqa: E402
from lightning_gkd.data.tokenizer import build_chatml_tokenizer  # noqa: E402
from lightning_gkd.ops.decoding.sampling import generate_completions  # noqa: E402
from lightning_gkd.ops.hf.forward import resolve_eos_token_id, resolve_pad_token_id  # noqa: E402
from lightning_gkd.samplers import VLLMSampler  # noqa: E402
from lightning_gkd.toy import addition_rows  # noqa: E402

STEPS, PER_RANK, SEED = 4, 4, 3


class RecordedVLLM(Recorded):
    def on_train_end(self) -> None:
        super().on_train_end()
        prompts = fixed_prompts(self.tokenizer)
        # the last step made the engine stale: this call syncs it (under FSDP a collective, on both ranks at once)
        greedy = self.sampler.greedy(
            self.student, prompts["prompts"], prompts["prompt_attention_mask"], max_new_tokens=6
        )
        self.final_greedy = greedy["input_ids"].tolist()
        self.engines, self.syncs = self.sampler.running_engines, self.sampler.syncs


def fixed_prompts(tokenizer) -> dict[str, torch.Tensor]:
    data = ChatDataModule(tokenizer, addition_rows("val", 8), batch_size=8, max_length=48, seed=0)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def make(tokenizer, sampler=None) -> RecordedVLLM:
    return RecordedVLLM(
        vllm_tiny("qwen2", tokenizer, seed=0),
        vllm_tiny("llama", tokenizer, seed=1),
        tokenizer,
        lmbda=0.5,
        divergence={"beta": 0.5},
        sampling={"max_new_tokens": 6, "sampler": sampler},
        # a float32 teacher: the replay runs outside a fit (no cast), float32 on both sides
        training={"optimizer": SGD, "seed": SEED, "frozen_dtype": "float32"},
    )


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tokenizer = build_chatml_tokenizer()
    L.seed_everything(0)
    data = ChatDataModule(tokenizer, addition_rows("train", 32), batch_size=PER_RANK, max_length=48, seed=SEED)
    module = make(tokenizer, VLLMSampler)
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if mode == "fsdp" else "ddp"
    fit(out, module, data, STEPS, strategy=strategy)
    trained = gather(module.trained)
    flips = gather([source for *_, source in module.flips])
    sampled = gather(module.sampled)
    engines, syncs = gather(module.engines), gather(module.syncs)
    greedy = gather(module.final_greedy)
    rank = dist.get_rank()
    if rank == 0:
        trained_weights = module._full_state_dict or module.student.state_dict()  # FSDP: gathered at fit end
        replay = make(tokenizer)
        optimizer = torch.optim.SGD([p for p in replay.student.parameters() if p.requires_grad], lr=LR)
        replay_losses = []
        for step in range(STEPS):
            batches = [{k: trained[r][step][k] for k in KEYS} for r in (0, 1)]
            losses = [replay.distillation_loss(b).loss for b in batches]
            tokens = [int((b["labels"] != -100).sum()) for b in batches]
            step_loss = sum(loss * n for loss, n in zip(losses, tokens, strict=True)) / sum(tokens)
            optimizer.zero_grad()
            step_loss.backward()
            optimizer.step()
            replay_losses.append([loss.item() for loss in losses])
        weight_diff = max(
            (trained_weights[k] - v).abs().max().item()
            for k, v in replay.student.state_dict().items()
            if k in trained_weights
        )
        reference = vllm_tiny("qwen2", tokenizer, seed=0)
        reference.load_state_dict(trained_weights, strict=False)
        prompts = fixed_prompts(tokenizer)
        hf_greedy = generate_completions(
            reference,
            prompts["prompts"],
            prompts["prompt_attention_mask"],
            max_new_tokens=6,
            pad_token_id=resolve_pad_token_id(tokenizer),
            eos_token_id=resolve_eos_token_id(reference, tokenizer),
            do_sample=False,
        )["input_ids"].tolist()
        result = {
            "world_size": dist.get_world_size(),
            "engines": engines,
            "syncs": syncs,
            "flips": flips,
            "ddp_losses": [[row["loss"] for row in part] for part in trained],
            "replay_losses": [list(pair) for pair in zip(*replay_losses, strict=True)],
            "sampled_prompts": sampled,
            "completions_differ_between_ranks": any(
                prompt_tokens(trained[0][s]["input_ids"], trained[0][s]["labels"] != -100)
                != prompt_tokens(trained[1][s]["input_ids"], trained[1][s]["labels"] != -100)
                for s in range(STEPS)
            ),
            "weights_vs_replay": weight_diff,
            "engine_greedy_equals_hf_greedy": [g == hf_greedy for g in greedy],
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
