"""Peak memory of one GKD loss forward + backward, lean (hidden states, chunked) vs full logits, on a Gemma 3-shaped
head: vocabulary 262,144 with final-logit soft-capping at 30 (tiny decoder, random weights, float32, CPU).

    python scripts/lean_memory.py [--positions 512] [--hidden 256]

Each measurement runs in its own process; the figure is the growth of the process's peak resident set over what
was resident once the models were built (so it counts what the loss adds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings


def measure(lean: bool, positions: int, hidden: int) -> dict[str, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_gkd.cli.compose import build_method
    from lightning_gkd.data.tokenizer import build_chatml_tokenizer
    from lightning_gkd.studies.process_memory import peak_rss_mb

    warnings.filterwarnings("ignore")
    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=262_144,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden // 2,
        final_logit_softcapping=30.0,
        layer_types=["full_attention", "full_attention"],
    )
    torch.manual_seed(0)
    student, teacher = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    settings = ["method=gkd", f"method.divergence.lean_loss={lean}", "method.sampling.max_new_tokens=4"]
    module = build_method(settings, student=student, teacher=teacher, tokenizer=build_chatml_tokenizer())
    rows = 2
    ids = torch.randint(3, 259, (rows, positions // rows + 1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch["labels"][:, 0] = -100
    before = peak_rss_mb()
    loss = module.distillation_loss(batch).loss
    loss.backward()
    after = peak_rss_mb()
    return {"loss": float(loss), "added_mb": after - before, "lean_taken": module.lean_path.enabled}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--worker", choices=["lean", "full"])
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker == "lean", args.positions, args.hidden)))
        return
    results = {}
    for kind in ("full", "lean"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                kind,
                "--positions",
                str(args.positions),
                "--hidden",
                str(args.hidden),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lean = results["full"], results["lean"]
    print(f"vocabulary 262144, soft-cap 30, {args.positions} supervised positions, hidden {args.hidden}")
    print(
        f"full logits: +{full['added_mb']:.0f} MB   lean: +{lean['added_mb']:.0f} MB (exact path: {lean['lean_taken']})"
    )
    print(
        f"ratio lean/full: {lean['added_mb'] / max(full['added_mb'], 1e-9):.3f}; "
        f"losses {full['loss']:.6f} vs {lean['loss']:.6f}"
    )


if __name__ == "__main__":
    main()
