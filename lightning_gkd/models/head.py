"""A causal LM's output head read from its checkpoint without loading the model.

A served teacher sends its final hidden states (after the final norm); turning them into its logits needs only its
head, ``logits = softcap(scale · (h @ Wᵀ + b))`` (:class:`~lightning_gkd.ops.hf.heads.LogitHead`). This module reads:

* ``config.json`` (``AutoConfig``), from which the model class is built on the meta device (no memory, no weights) to
  learn the output projection's parameter names (``get_output_embeddings()``), whether its weight is tied to the
  input embedding (then a checkpoint may store it under the embedding's name only), its bias, and the scale and
  soft-cap the config names (:func:`~lightning_gkd.ops.hf.heads.output_head`);
* the safetensors index (``model.safetensors.index.json``) or the single file's header (``model.safetensors``), to
  find the file holding each head tensor;
* only those tensors (``safe_open(file).get_tensor(name)``): ``V × H`` numbers (and ``V`` for a bias), not the
  model. From the hub only ``config.json``, the index and the shard(s) holding the head are downloaded (a
  single-file checkpoint is downloaded whole; still only the head is read from it).

Only safetensors are read (no pickles). A class whose head the description cannot reproduce is refused: statically
(an output projection that is not a plain ``nn.Linear``, parameters between the decoder and the head) and, with
``check=True``, numerically: a small model of the same class, built from a shrunk copy of the config that keeps its
head-transform fields, must give its own logits through the description (``ops.hf.check_output_head``), once per
(class, transform) and process: tens of milliseconds for common families once torch has warmed up.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)

from lightning_gkd.models.loading import resolve_dtype
from lightning_gkd.models.vision import is_vision_language_config
from lightning_gkd.ops.hf.heads import (
    LeanForwardUnsupported,
    LogitHead,
    check_head_parameters,
    check_output_head,
    output_head,
)

__all__ = ["HeadFile", "load_output_head", "read_output_head"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: The shrunk config of the numeric check (and of the tests' tiny model of every family): these fields (names differ
#: across families) get these values when the text config has them; head-transform fields
#: (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``) and ``tie_word_embeddings`` are left as they are.
SHRUNK_FIELDS: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_inner": 128,
    "n_positions": 128,
    "d_model": 64,
    "ffn_dim": 128,
    "num_layers": 2,
    "num_heads": 2,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "sliding_window": 16,
    "num_layers_per_stack": 2,  # HRM's recurrent stacks
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_SMALL_MAX_PARAMETERS = 5_000_000
_PROBE_LENGTH = 8
#: the small model's logits are scaled to about this standard deviation, where a soft-cap (Gemma: 30) bites
_PROBE_LOGIT_STD = 15.0
#: (model class, scale, softcap, tied, bias) proven by the numeric check in this process
_PROVEN: set[tuple[type, float, float | None, bool, bool]] = set()
_UNSUPPORTED_ADVICE = (
    "its final hidden states cannot stand in for its logits. Distil from its log-probs instead (teacher.kind=server "
    "with top_k, or kind=cache), or run it in the process (teacher.kind=local)."
)


@dataclass(frozen=True)
class HeadFile:
    """Where a head was read from: the model class its config names, the stored tensor names read (the weight, then
    the bias), the safetensors file(s) holding them, the bytes read (as stored), and whether the weight is the input
    embedding's (tied)."""

    model_class: str
    names: tuple[str, ...]
    files: tuple[str, ...]
    nbytes: int
    tied: bool

    def summary(self) -> str:
        """One line for a log: ``read 1 tensor (model.embed_tokens.weight), 1.3 MB, from model.safetensors``."""
        count = f"{len(self.names)} tensor{'s' if len(self.names) != 1 else ''}"
        files = ", ".join(Path(file).name for file in self.files)
        return f"read {count} ({', '.join(self.names)}), {self.nbytes / 1e6:.1f} MB, from {files}"


@dataclass(frozen=True)
class _Layout:
    """The head as the meta-device model of the config describes it."""

    model_class: type
    weight_names: tuple[str, ...]  # where the weight may be stored: the head's own name first, then its aliases
    bias_names: tuple[str, ...]  # empty: no bias
    shape: tuple[int, int]  # (V, H)
    scale: float
    softcap: float | None
    tied: bool
    rename: Callable[[str], str] = field(compare=False)  # a stored name -> the model's, as from_pretrained renames

    @property
    def class_name(self) -> str:
        return self.model_class.__name__


def load_output_head(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    check: bool = True,
) -> LogitHead:
    """The output head of the causal LM at ``source``, read from its safetensors without loading the model.

    Args:
        source: a local folder written by ``save_pretrained`` (``model.safetensors``, or shards with
            ``model.safetensors.index.json``), or a hub id.
        revision: the hub revision (branch, tag, commit); ignored for a local folder.
        dtype: cast the tensors to it (``torch.bfloat16``, ``"float32"``, ...); None or ``"auto"`` keeps the stored
            dtype.
        trust_remote_code: let ``AutoConfig``/``AutoModelForCausalLM`` run the repository's own code.
        check: prove once per process, on a small randomly initialised model of the same class, that the head's
            description reproduces the class's logits (well under a second, the first time only).

    Returns:
        The :class:`LogitHead` (weight ``(V, H)``, bias ``(V,)`` or None, scale, soft-cap) on the CPU.

    Raises:
        ValueError: naming the model class and what to do, when its head is not a plain linear projection (or fails
            the numeric check), when there are no safetensors, when a head tensor is missing from them, or when its
            shape disagrees with the config.
    """
    return read_output_head(source, revision=revision, dtype=dtype, trust_remote_code=trust_remote_code, check=check)[0]


def read_output_head(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    check: bool = True,
) -> tuple[LogitHead, HeadFile]:
    """:func:`load_output_head` and what was read (:class:`HeadFile`: tensor names, files, bytes) for the log."""
    cast_to = resolve_dtype(dtype)
    folder = _local_folder(source)
    repo = str(source)
    config = _read_config(folder, repo, revision=revision, trust_remote_code=trust_remote_code)
    layout = _layout(config, trust_remote_code=trust_remote_code)
    weight_map = _weight_map(folder, repo, revision=revision, layout=layout)
    weight_name = _stored_name(layout.weight_names, weight_map, layout, source, "weight")
    bias_name = _stored_name(layout.bias_names, weight_map, layout, source, "bias") if layout.bias_names else None
    if check:
        _check_class(config, layout, trust_remote_code=trust_remote_code)
    names = (weight_name,) if bias_name is None else (weight_name, bias_name)
    paths = {name: _shard(folder, repo, weight_map[name], revision=revision, name=name) for name in names}
    tensors = {}
    for name in names:
        with safe_open(paths[name], "pt") as handle:
            tensors[name] = handle.get_tensor(name)
    weight = tensors[weight_name]
    bias = tensors[bias_name] if bias_name is not None else None
    _check_tensor(weight, layout.shape, weight_name, layout)
    if bias is not None:
        _check_tensor(bias, layout.shape[:1], bias_name or "", layout)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    if isinstance(cast_to, torch.dtype):
        weight = weight.to(cast_to)
        bias = bias.to(cast_to) if bias is not None else None
    files = tuple(dict.fromkeys(str(paths[name]) for name in names))
    info = HeadFile(layout.class_name, names, files, nbytes, layout.tied)
    return LogitHead(weight, bias, layout.scale, layout.softcap), info


def _local_folder(source: str | os.PathLike[str]) -> Path | None:
    """The folder ``source`` names, None for a hub id; ValueError for a path that is not a folder."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    looks_like_path = isinstance(source, os.PathLike) or str(source).startswith((".", "/", "~")) or path.exists()
    if looks_like_path or str(source).count("/") > 1:
        raise ValueError(
            f"{source} is not a folder. Pass a folder written by save_pretrained (config.json and safetensors) or a "
            "hub id such as 'Qwen/Qwen2.5-0.5B'."
        )
    return None


def _fetch(folder: Path | None, repo: str, filename: str, *, revision: str | None) -> str | None:
    """The local path of ``filename`` in the folder or hub repository, None when the repository has no such file."""
    if folder is not None:
        path = folder / filename
        return str(path) if path.is_file() else None
    try:
        return hf_hub_download(repo_id=repo, filename=filename, revision=revision)
    except EntryNotFoundError as error:
        if isinstance(error, LocalEntryNotFoundError):  # offline and not cached: not an answer about the repository
            raise
        return None


def _shard(folder: Path | None, repo: str, filename: str, *, revision: str | None, name: str) -> str:
    """The local path of the safetensors file the index names for tensor ``name``; ValueError when it is absent."""
    path = _fetch(folder, repo, filename, revision=revision)
    if path is None:
        raise ValueError(
            f"{INDEX_FILE} puts {name} in {filename}, which {folder or repo} does not have: the checkpoint is "
            "incomplete; download or save it again."
        )
    return path


def _read_config(folder: Path | None, repo: str, *, revision: str | None, trust_remote_code: bool) -> PretrainedConfig:
    if folder is not None:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    config_file = _fetch(None, repo, "config.json", revision=revision)
    if config_file is None:
        raise ValueError(f"The hub repository {repo} has no config.json; pass a causal LM's repository or folder.")
    if trust_remote_code:  # the config's code lives in the repository
        return AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=True)
    return AutoConfig.from_pretrained(Path(config_file).parent)


def _unsupported(class_name: str, error: LeanForwardUnsupported) -> str:
    return f"{class_name}'s head cannot be read as a LogitHead ({error}): {_UNSUPPORTED_ADVICE}"


def _auto_class(config: PretrainedConfig) -> Any:
    """The auto class that loads the whole model: ``AutoModelForImageTextToText`` for a vision-language config (its
    causal-LM class, where one exists, is the text model alone)."""
    return AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM


def _layout(config: PretrainedConfig, *, trust_remote_code: bool) -> _Layout:
    """The head's names, shape and transforms from the class built on the meta device; ValueError naming the class
    when its head is not a plain linear projection right after the decoder."""
    with torch.device("meta"):
        model = _auto_class(config).from_config(config, trust_remote_code=trust_remote_code)
    class_name = type(model).__name__
    try:
        check_head_parameters(model)
        head = output_head(model)
    except LeanForwardUnsupported as error:
        raise ValueError(_unsupported(class_name, error)) from error
    projection = model.get_output_embeddings()
    prefix = next((name for name, module in model.named_modules() if module is projection), None)
    if prefix is None:
        raise ValueError(
            f"{class_name}'s output projection is not one of its own modules, so its stored name is unknown: "
            f"{_UNSUPPORTED_ADVICE}"
        )

    def aliases(tensor: torch.Tensor | None, leaf: str) -> tuple[str, ...]:
        if tensor is None:
            return ()
        own = f"{prefix}.{leaf}" if prefix else leaf
        others = [name for name, p in model.named_parameters(remove_duplicate=False) if p is tensor and name != own]
        return (own, *others)

    weight_names = aliases(head.weight, "weight")
    return _Layout(
        model_class=type(model),
        weight_names=weight_names,
        bias_names=aliases(head.bias, "bias"),
        shape=(int(head.weight.shape[0]), int(head.weight.shape[1])),
        scale=head.scale,
        softcap=head.softcap,
        tied=len(weight_names) > 1,
        rename=_checkpoint_renamer(model),
    )


def _checkpoint_renamer(model: PreTrainedModel) -> Callable[[str], str]:
    """A stored tensor name -> the model's parameter name, as ``from_pretrained`` renames it: transformers 5's
    conversion mapping (legacy names such as GPT-NeoX's ``embed_out`` for ``lm_head``) and a missing or extra
    base-model prefix."""
    try:  # transformers' loading internals (5.x); without them only the model's own names are looked up
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
    except Exception:
        return lambda key: key
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        renamed = rename_source_key(key, renamings, converters, prefix, meta_state)[0]
        return key if renamed not in meta_state and key in meta_state else renamed

    return rename


def _weight_map(folder: Path | None, repo: str, *, revision: str | None, layout: _Layout) -> dict[str, str]:
    """Stored tensor name -> the file holding it (relative to the checkpoint), from the index or the single file's
    header; ValueError when there are no safetensors."""
    index = _fetch(folder, repo, INDEX_FILE, revision=revision)
    if index is not None:
        with open(index) as handle:
            return dict(json.load(handle)["weight_map"])
    single = _fetch(folder, repo, SINGLE_FILE, revision=revision)
    if single is None:
        where = f"The folder {folder}" if folder is not None else f"The hub repository {repo}"
        others = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth"}) if folder else []
        found = f" (it has {', '.join(others)})" if others else ""
        raise ValueError(
            f"{where} has neither {SINGLE_FILE} nor {INDEX_FILE}{found}: only safetensors are read for "
            f"{layout.class_name}'s head. Re-save the model with save_pretrained (which writes safetensors), or load "
            "it in the process (teacher.kind=local)."
        )
    with safe_open(single, "pt") as handle:
        return dict.fromkeys(handle.keys(), SINGLE_FILE)


def _stored_name(
    candidates: tuple[str, ...], weight_map: dict[str, str], layout: _Layout, source: Any, what: str
) -> str:
    for name in candidates:
        if name in weight_map:
            return name
    renamed: dict[str, str] = {}  # the model's name -> the stored one, for checkpoints in another naming
    for stored in weight_map:
        renamed.setdefault(layout.rename(stored), stored)
    for name in candidates:
        if name in renamed:
            return renamed[name]
    near = sorted(name for name in weight_map if any(word in name for word in ("lm_head", "embed", "output")))[:5]
    raise ValueError(
        f"{source} stores no {layout.class_name} head {what}: looked for {' or '.join(candidates)} (or a legacy "
        f"name transformers renames to it) among its {len(weight_map)} tensors (head-like names there: "
        f"{', '.join(near) or 'none'}). The safetensors may come from another model or layout than its config.json; "
        "re-save the model with save_pretrained."
    )


def _check_tensor(tensor: torch.Tensor, shape: tuple[int, ...], name: str, layout: _Layout) -> None:
    if tuple(tensor.shape) != shape:
        expected = "(vocab_size, hidden_size)" if len(shape) == 2 else "(vocab_size,)"
        raise ValueError(
            f"{name} is stored with shape {tuple(tensor.shape)} but {layout.class_name}'s config gives {shape} "
            f"{expected}: config.json and the safetensors disagree; check they come from the same model and revision."
        )
    if tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} is stored as {tensor.dtype} (a quantized checkpoint?); only float16/bfloat16/float32 heads are "
            f"read for {layout.class_name}. Use an unquantized checkpoint of the model."
        )


def _shrunk_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` with small sizes (``SHRUNK_FIELDS``) and per-layer lists cut to the new layer count; the
    head-transform fields and ``tie_word_embeddings`` are kept."""
    small = copy.deepcopy(config)
    get_text_config = getattr(small, "get_text_config", None)
    text = get_text_config() if callable(get_text_config) else small
    vision = getattr(small, "vision_config", None)  # a vision-language model's tower: only feeds the decoder's input
    for part in (text, vision) if isinstance(vision, PretrainedConfig) else (text,):
        _shrink(part)
    return small


def _shrink(config: PretrainedConfig) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    for name, value in SHRUNK_FIELDS.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except Exception:  # a derived or validated field: keep its value
                pass
    new_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and isinstance(new_layers, int) and new_layers < layers:
        for name, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == layers:  # one entry per layer (layer_types, ...)
                setattr(config, name, value[:new_layers])


def _check_class(config: PretrainedConfig, layout: _Layout, *, trust_remote_code: bool) -> None:
    """Once per (class, transform): a small random model of the class gives its own logits through the description.
    ValueError naming the class when it does not, or when no small model of it can be built."""
    key = (layout.model_class, layout.scale, layout.softcap, layout.tied, bool(layout.bias_names))
    if key in _PROVEN:
        return
    try:
        small = _shrunk_config(config)
        with torch.device("meta"):
            sized = _auto_class(small).from_config(small, trust_remote_code=trust_remote_code)
        count = sum(p.numel() for p in sized.parameters())
        if type(sized) is not layout.model_class or count > _SMALL_MAX_PARAMETERS:
            raise ValueError(f"the shrunk config gives {type(sized).__name__} with {count:,} parameters")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            with torch.device("cpu"):  # only around the build: a device context slows every op of the forwards
                model: nn.Module = _auto_class(small).from_config(small, trust_remote_code=trust_remote_code)
            model = model.float().eval()
            vocab = int(output_head(model).weight.shape[0])
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(min(3, vocab - 1), vocab, (1, _PROBE_LENGTH), generator=generator)
            mask = torch.ones_like(ids)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                output_head(model).weight.mul_(_PROBE_LOGIT_STD / max(float(logits.float().std()), 1e-6))
            check_output_head(model, ids, mask)
    except LeanForwardUnsupported as error:
        raise ValueError(_unsupported(layout.class_name, error)) from error
    except Exception as error:
        raise ValueError(
            f"Could not check {layout.class_name}'s head on a small model of its class built from a shrunk copy of "
            f"its config ({type(error).__name__}: {str(error)[:300]}). Pass check=False to read the head without "
            "this proof: the static checks still run (a plain linear head right after the decoder), what is skipped "
            "is the proof that the class's forward applies no transform its config does not name."
        ) from error
    _PROVEN.add(key)
