"""A causal LM's output head and its final hidden states at chosen positions (the lean losses' inputs), proven
against the model's own logits once per model.

Hidden states at chosen positions come through the model's own (outermost) ``forward``, so wrappers keep working:
PEFT adapters, FSDP2 units (whose hooks gather parameters) and DDP. A forward hook on the decoder captures its
output, and ``logits_to_keep`` (an empty index) tells the language-model head to project no position at all.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from lightning_gkd.ops.hf.forward import eval_mode, unwrap
from lightning_gkd.ops.hf.model_inputs import VisionRows, lm_inputs

__all__ = [
    "LeanForwardUnsupported",
    "LogitHead",
    "SharedRangeHead",
    "check_head_parameters",
    "check_output_head",
    "final_hidden_states",
    "hidden_states_and_head",
    "output_head",
    "output_rows",
    "output_weight",
]


class LeanForwardUnsupported(RuntimeError):
    """The model lacks what the hidden-state path needs (a decoder, a linear output projection whose logits the
    head description reproduces, or ``logits_to_keep``); use full logits instead."""


class _CausalLMCore(Protocol):
    """What the lean path calls on the unwrapped model (``_causal_lm`` checks each at run time)."""

    def get_decoder(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


#: Classes whose ``get_decoder()`` does not return the text decoder (the module whose output is the final, normed
#: hidden states), by class name: the attribute path from the model to it. Their ``base_model_prefix`` names an
#: attribute they do not have (``language_model``), so transformers' default returns the model itself.
_DECODER_PATHS: dict[str, str] = {
    "Llama4ForCausalLM": "model",
    "Llama4ForConditionalGeneration": "language_model.model",
    "MllamaForCausalLM": "model",
}
#: Modules that only feed the decoder's input (a vision tower and its projector), by class name: their parameters are
#: not between the decoder and the head, so :func:`check_head_parameters` does not count them against the head.
_INPUT_SIDE_PATHS: dict[str, tuple[str, ...]] = {
    "FuyuForCausalLM": ("model.vision_embed_tokens",),
    "Llama4ForConditionalGeneration": ("vision_model", "multi_modal_projector"),
    "MllamaForConditionalGeneration": ("model.vision_model", "model.multi_modal_projector"),
}


def _submodule(core: _CausalLMCore, path: str) -> nn.Module:
    module: Any = core
    for name in path.split("."):
        module = getattr(module, name, None)
    if not isinstance(module, nn.Module):
        raise LeanForwardUnsupported(f"{type(core).__name__} has no module at .{path}")
    return module


def _decoder(core: _CausalLMCore) -> nn.Module:
    """The text decoder of the unwrapped causal LM ``core``: the path in ``_DECODER_PATHS`` for its class, else its
    ``get_decoder()``. :func:`check_output_head` proves that its output and the head give the model's logits."""
    path = _DECODER_PATHS.get(type(core).__name__)
    return core.get_decoder() if path is None else _submodule(core, path)


def _causal_lm(model: nn.Module) -> _CausalLMCore:
    core = unwrap(model)
    for attribute in ("get_decoder", "get_output_embeddings"):
        if not callable(getattr(core, attribute, None)):
            raise LeanForwardUnsupported(f"{type(core).__name__} has no {attribute}()")
    if "logits_to_keep" not in inspect.signature(core.forward).parameters:
        raise LeanForwardUnsupported(f"{type(core).__name__}.forward does not take logits_to_keep")
    return cast(_CausalLMCore, core)


@dataclass(frozen=True)
class LogitHead:
    """What a causal LM's head does to its final hidden states ``h``:
    ``logits = softcap(scale · (h @ weightᵀ + bias))`` with ``softcap(z) = cap · tanh(z / cap)`` when ``softcap`` is
    set. Plain heads (Llama, Qwen, Mistral, ...) are ``scale = 1``, no bias, no cap; Gemma 2/3 soft-cap
    (``final_logit_softcapping``), Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0
    softcap: float | None = None

    def transform(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        """``(logits, d logits / d projected)`` from ``projected = h @ weightᵀ + bias`` (float32 in, float32 out);
        the derivative is elementwise, a constant, or None for the identity."""
        z = projected * self.scale if self.scale != 1 else projected
        if self.softcap is None:
            return z, (self.scale if self.scale != 1 else None)
        capped = torch.tanh(z / self.softcap)
        return self.softcap * capped, self.scale * (1 - capped * capped)

    def first_rows(self, rows: int) -> LogitHead:
        """The head over token ids ``[0, rows)`` only: what a model whose projection has just those rows gives."""
        if rows >= self.weight.shape[0]:
            return self
        bias = None if self.bias is None else self.bias[:rows]
        return LogitHead(self.weight[:rows], bias, self.scale, self.softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        projected = (hidden @ self.weight.t()).float()
        if self.bias is not None:
            projected = projected + self.bias.float()
        return self.transform(projected)[0]


#: The head transforms the lean path knows, by config field (read from the text config): softcap after scaling.
_SOFTCAP_FIELDS = ("final_logit_softcapping",)  # Gemma 2, Gemma 3: logits = cap * tanh(logits / cap)
_MULTIPLY_FIELDS = ("logit_scale",)  # Cohere, Command-R: logits * logit_scale
_DIVIDE_FIELDS = ("logits_scaling",)  # Granite: logits / logits_scaling


class SharedRangeHead(nn.Linear):
    """An output projection that gives logits for token ids ``[0, rows)`` only, ``rows`` at most its weight's rows:
    the model then is exactly the model truncated to those rows, while its parameters (names, shapes, a tie to the
    input embedding) stay as they are, so checkpoints and exports keep the full matrix. Rows past ``rows`` take no
    gradient. ``models.loading.limit_output_rows`` turns a model's ``nn.Linear`` head into one (padded vocabularies
    over one tokenizer)."""

    rows: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[: self.rows]
        return nn.functional.linear(input, self.weight[: self.rows], bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows}"


def output_rows(projection: nn.Module) -> int | None:
    """How many logits an output projection gives: ``rows`` for a :class:`SharedRangeHead`, else its weight's rows
    (None without a weight)."""
    if isinstance(projection, SharedRangeHead):
        return projection.rows
    weight = getattr(projection, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def output_head(model: nn.Module) -> LogitHead:
    """The model's head as a :class:`LogitHead`: its output projection (an ``nn.Linear``, bias allowed; a
    :class:`SharedRangeHead` gives its first ``rows`` rows) and the transforms its config names.
    :func:`check_output_head` proves once that they reproduce the model's logits."""
    core = _causal_lm(model)
    head = core.get_output_embeddings()
    extra = {name for name, _ in head.named_parameters()} - {"weight", "bias"} if isinstance(head, nn.Module) else set()
    if (
        not isinstance(head, nn.Linear)
        or type(head).forward not in (nn.Linear.forward, SharedRangeHead.forward)
        or extra
    ):
        raise LeanForwardUnsupported(f"output projection {type(head).__name__} is not a plain nn.Linear")
    config: Any = getattr(core, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else config
    scale, softcap = 1.0, None
    for name in _MULTIPLY_FIELDS:
        if (value := getattr(text, name, None)) is not None:
            scale *= float(value)
    for name in _DIVIDE_FIELDS:
        if (value := getattr(text, name, None)) is not None:
            scale /= float(value)
    for name in _SOFTCAP_FIELDS:
        if (value := getattr(text, name, None)) is not None:
            softcap = float(value)
    return LogitHead(head.weight, head.bias, scale, softcap).first_rows(output_rows(head) or head.weight.shape[0])


def output_weight(model: nn.Module) -> torch.Tensor:
    """The ``(V, H)`` weight of the model's output projection (``lm_head``)."""
    return output_head(model).weight


def check_head_parameters(model: nn.Module) -> None:
    """The static part of :func:`check_output_head`, which needs no forward (a model on the meta device will do):
    raises ``LeanForwardUnsupported`` naming the model class when its output projection is not a plain ``nn.Linear``
    (:func:`output_head`) or when it has parameters outside its decoder and that projection (a head MLP, a learned
    scale: the head does more than the description says). Modules that only feed the decoder's input (a vision tower
    and its projector: under the base model that holds the decoder, or ``_INPUT_SIDE_PATHS``) are not counted."""
    output_head(model)
    core = _causal_lm(model)
    projection = core.get_output_embeddings()
    assert projection is not None  # output_head checked it is an nn.Linear
    # anything trainable between the decoder and the projection (a head MLP, a learned scale) is not described
    decoder = _decoder(core)
    covered = {id(p) for p in decoder.parameters()} | {id(p) for p in projection.parameters()}
    for path in _INPUT_SIDE_PATHS.get(type(core).__name__, ()):
        covered |= {id(p) for p in _submodule(core, path).parameters()}
    base = getattr(core, "model", None)
    if isinstance(base, nn.Module) and base is not decoder and any(m is decoder for m in base.modules()):
        # a vision-language model's base (transformers 5: ``model.vision_tower``, ``model.multi_modal_projector``,
        # ``model.language_model``): what it holds besides the decoder only makes the decoder's input
        covered |= {id(p) for p in base.parameters()}
    outside = [name for name, p in core.named_parameters() if id(p) not in covered]
    if outside:
        raise LeanForwardUnsupported(
            f"{type(core).__name__} has parameters outside its decoder and lm_head ({', '.join(outside[:3])}), so its "
            "head does more than a projection"
        )


_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def check_output_head(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: VisionRows | None = None
) -> None:
    """Prove, once per model, that :func:`output_head` reproduces the model's own logits: the first row of the batch
    runs through ``model`` (eval mode, no grad) and the head's description must give its last positions' logits.
    Raises ``LeanForwardUnsupported`` naming the model class when it does not (a head transform the description does
    not know: a custom head, remote code, a new config field), so the caller falls back to full logits. Read the
    head itself with ``output_head`` after the model's forward (FSDP2 gathers the root unit's weights there)."""
    if _CHECKED.get(model):
        return
    check_head_parameters(model)
    head = output_head(model)
    ids, mask, images = input_ids[:1], attention_mask[:1], (None if vision is None else vision[:1])
    keep = min(4, ids.shape[1])
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[:, -keep:] = True
    with torch.no_grad(), eval_mode(model):
        expected = (
            model(**lm_inputs(model, ids, mask, images), use_cache=False, logits_to_keep=keep).logits[0, -keep:].float()
        )
        hidden = final_hidden_states(model, ids, mask, positions, images)
        if hidden.shape[-1] != head.weight.shape[1]:
            raise LeanForwardUnsupported(
                f"{type(unwrap(model)).__name__}'s final hidden states have {hidden.shape[-1]} features but its "
                f"lm_head takes {head.weight.shape[1]}: something projects between them"
            )
        got = output_head(model).logits(hidden)
    tolerance = 1e-5 * max(1.0, float(expected.abs().max()))
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-5, atol=tolerance):
        difference = float((got - expected).abs().max()) if got.shape == expected.shape else float("nan")
        raise LeanForwardUnsupported(
            f"{type(unwrap(model)).__name__}'s logits are not softcap(scale * (hidden @ lm_head.weight.T + bias)) "
            f"with the transforms its config names (scale {head.scale:g}, softcap {head.softcap}): the largest "
            f"difference on a probe was {difference:.3g}"
        )
    _CHECKED[model] = True


def final_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    vision: VisionRows | None = None,
) -> torch.Tensor:
    """The decoder's final (normed) hidden states at ``positions``.

    Args:
        model: a Hugging Face causal LM, possibly wrapped (PEFT, FSDP2 units).
        input_ids: ``(B, L)`` left-padded tokens.
        attention_mask: ``(B, L)``, 1 on real tokens; position ids are counted from each row's first real token.
        positions: ``(B, L)`` bool, the positions to return.
        vision: the rows' image inputs (``ops.hf.model_inputs``), None for text.

    Returns:
        ``(N, H)`` hidden states of the ``N = positions.sum()`` selected positions, in row-major order (the order
        of ``tensor[positions]``).
    """
    decoder = _decoder(_causal_lm(model))
    captured: dict[str, torch.Tensor] = {}

    def capture(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        captured["hidden"] = hidden if hidden is not None else output[0]

    handle = decoder.register_forward_hook(capture)
    try:
        model(
            **lm_inputs(model, input_ids, attention_mask, vision),
            use_cache=False,
            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
        )
    finally:
        handle.remove()
    hidden = captured.get("hidden")
    if hidden is None:
        raise LeanForwardUnsupported(f"{type(decoder).__name__} did not run in the model's forward")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise LeanForwardUnsupported(
            f"{type(decoder).__name__}'s output {shape} is not the (batch, length, hidden) final hidden states"
        )
    return hidden[positions]


def hidden_states_and_head(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    vision: VisionRows | None = None,
) -> tuple[torch.Tensor, LogitHead]:
    """``(N, H)`` final hidden states at ``positions`` (:func:`final_hidden_states`) and the head that turns them into
    exactly the model's logits (:func:`output_head`, proven once per model by :func:`check_output_head`).
    ``vision``: the rows' image inputs (``ops.hf.model_inputs``). The head is
    read after the forward, where FSDP2 has gathered the root unit's weights. Raises ``LeanForwardUnsupported`` for a
    model whose head the description does not reproduce."""
    check_output_head(model, input_ids, attention_mask, vision)
    hidden = final_hidden_states(model, input_ids, attention_mask, positions, vision)
    return hidden, output_head(model)
