"""Load the student, teacher and reference models: an nn.Module, a local folder, a hub id, or a config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias, cast

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from lightning_gkd.models.vision import is_vision_language_config
from lightning_gkd.ops.hf.heads import SharedRangeHead, output_rows

ModelSource: TypeAlias = nn.Module | str | os.PathLike | PretrainedConfig | Mapping[str, Any]

# "tokenizer": a teacher's tokenizer (cross-tokenizer distillation reads it; loading ignores it)
_SPEC_KEYS = {"name_or_path", "config", "init_kwargs", "trust_remote_code", "lora", "tokenizer"}


def resolve_dtype(value: Any) -> Any:
    """``"bfloat16"``/``"torch.float32"``/``"auto"``/``torch.dtype``/None -> what ``from_pretrained(dtype=)`` takes."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {value!r}; use e.g. 'float32', 'bfloat16', 'float16' or 'auto'.")
    return dtype


def load_causal_lm(
    source: ModelSource,
    *,
    init_kwargs: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    role: str = "model",
) -> nn.Module:
    """Build or load a causal LM.

    ``source`` may be: an ``nn.Module`` (returned as is); a local folder written by ``save_pretrained`` or a hub
    id (``AutoModelForCausalLM.from_pretrained``, or ``AutoModelForImageTextToText``'s for a vision-language model,
    with ``init_kwargs`` such as ``dtype``, ``attn_implementation``, ``revision``, ``quantization_config``); a
    ``PretrainedConfig`` (a freshly initialised model); or a mapping
    ``{"name_or_path": ..., "init_kwargs": {...}, "trust_remote_code": bool}`` or ``{"config": {"model_type":
    "qwen2", ...}}`` as written in Hydra configs. Remote code runs only when ``trust_remote_code`` is True.
    A mapping's ``lora`` entry (``{"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear", ...}``,
    see ``lightning_gkd.models.lora``) wraps the loaded model in LoRA adapters (a ``peft.PeftModel`` whose only
    trainable weights are the adapters); ``r`` null or 0 means no adapters.
    """
    if isinstance(source, nn.Module):
        return source
    if isinstance(source, Mapping) and source.get("lora") is not None:
        from lightning_gkd.models.lora import apply_lora, lora_enabled

        base_spec = {key: value for key, value in source.items() if key != "lora"}
        model = load_causal_lm(base_spec, init_kwargs=init_kwargs, trust_remote_code=trust_remote_code, role=role)
        return apply_lora(model, source["lora"], role=role) if lora_enabled(source["lora"]) else model
    kwargs = dict(init_kwargs or {})
    if isinstance(source, Mapping):
        unknown = set(source) - _SPEC_KEYS
        if unknown:
            raise ValueError(
                f"{role}: unknown key(s) {sorted(unknown)} in the model spec; allowed: {sorted(_SPEC_KEYS)}."
            )
        kwargs = {**dict(source.get("init_kwargs") or {}), **kwargs}
        trust_remote_code = bool(source.get("trust_remote_code", trust_remote_code))
        if source.get("config") is not None:
            config = source["config"]
            if isinstance(config, Mapping):
                config = dict(config)
                if "model_type" not in config:
                    raise ValueError(f"{role}: a config spec needs a 'model_type' (e.g. 'qwen2', 'llama').")
                config = AutoConfig.for_model(config.pop("model_type"), **config)
            return _from_config(config, kwargs, trust_remote_code)
        if not source.get("name_or_path"):
            raise ValueError(f"{role}: the model spec needs 'name_or_path' (a folder or hub id) or 'config'.")
        source = source["name_or_path"]
    if isinstance(source, PretrainedConfig):
        return _from_config(source, kwargs, trust_remote_code)
    name = str(source)
    folder = Path(name).expanduser()
    if folder.is_dir():
        name = str(folder)
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(
            f"{role}: model folder {name!r} does not exist. Pass an existing folder written by "
            "save_pretrained, or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    else:
        check_hub_id_reachable(role, name, kwargs.get("revision"))
    if "dtype" in kwargs:
        kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
    if isinstance(kwargs.get("quantization_config"), Mapping):
        kwargs["quantization_config"] = quantization_config_from_dict(kwargs["quantization_config"])
    config = AutoConfig.from_pretrained(name, revision=kwargs.get("revision"), trust_remote_code=trust_remote_code)
    # a vision-language model whole: its causal-LM class (where one exists) drops the tower
    auto: Any = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    return auto.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached now: HF_HUB_OFFLINE unset and a TCP connection to its endpoint
    opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def check_hub_id_reachable(role: str, name: str, revision: str | None = None) -> None:
    """A ``name`` that is no local folder is a hub id: unless that model is in the local hub cache, fail at once when
    the hub cannot be reached (offline, or no network), naming the missing folder first, instead of the hub
    client's retries and a long network traceback."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:  # not a valid repo id either (e.g. two slashes, odd characters)
        cached = None
    if isinstance(cached, str) or hub_reachable():
        return
    raise FileNotFoundError(
        f"{role}: no local folder {name!r} (relative to {Path.cwd()}); as a hub id it could not be reached "
        "(HF_HUB_OFFLINE is set or the hub is unreachable) and is not in the local hub cache. Check the path, or "
        "download the model first."
    )


def quantization_config_from_dict(spec: Mapping[str, Any]) -> Any:
    """A plain mapping from YAML/JSON -> a transformers quantization config: with a ``quant_method`` key, any kind
    transformers knows; without one, ``BitsAndBytesConfig(**spec)`` (e.g. ``{"load_in_8bit": True}``)."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoQuantizationConfig

    spec = dict(spec)
    if "quant_method" in spec:
        return AutoQuantizationConfig.from_dict(spec)
    return BitsAndBytesConfig(**spec)


def _from_config(config: PretrainedConfig, kwargs: dict[str, Any], trust_remote_code: bool) -> nn.Module:
    dtype = resolve_dtype(kwargs.pop("dtype", None))
    auto = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    model = auto.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    if isinstance(dtype, torch.dtype):
        model = model.to(dtype)
    return model


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name == "layerdrop"


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability in ``model`` to 0: ``nn.Dropout`` modules, and the float rates that modules
    (``self.dropout``, ``self.attention_dropout``, OPT/BART's ``layerdrop``, ...) and configs hold for functional
    dropout, which ``nn.Dropout`` alone misses."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(cast(Any, module), name, 0.0)
        config = getattr(module, "config", None)
        if config is not None:
            get_text_config = getattr(config, "get_text_config", None)
            configs = {id(c): c for c in (config, get_text_config() if callable(get_text_config) else None) if c}
            for conf in configs.values():
                for name, value in list(vars(conf).items()):
                    if _is_dropout_name(name) and isinstance(value, float):
                        setattr(conf, name, 0.0)
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Make ``model`` a fixed function: no gradients, eval mode, dropout off."""
    model.requires_grad_(False)
    disable_dropout(model)
    return model.eval()


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the output projection (the logits' last dim; a head limited by ``limit_output_rows`` gives its
    limit), falling back to ``config.vocab_size``."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    rows = output_rows(head) if head is not None else None
    if rows is not None:
        return rows
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def shared_vocab_rows(tokenizer: Any, rows: Mapping[str, int | None]) -> int | None:
    """The token ids ``[0, V)`` that models over one tokenizer are compared on: ``V`` is the fewest output rows among
    ``rows`` (role -> rows; None: not known), so models padded differently past the tokenizer (Qwen2.5-7B's 152,064
    rows and 0.5B's 151,936 over 151,665 tokens) distil over the rows they share. Ids past the tokenizer are never a
    label or a prompt token; a model's mass on them is dropped and its distribution renormalised over ``[0, V)``
    (``limit_output_rows``). None when no size is known. ``ValueError`` when a model has fewer rows than the
    tokenizer has tokens (ids would index past it), naming the role."""
    tokens = len(tokenizer)
    known = {role: int(size) for role, size in rows.items() if size is not None}
    name = getattr(tokenizer, "name_or_path", "")
    for role, size in known.items():
        if size < tokens:
            raise ValueError(
                f"The {role}'s vocabulary has {size} rows but the tokenizer ({name!r}) has {tokens} tokens: ids "
                f"{size} and up have no row in the {role}. Distilling over one tokenizer needs every model to "
                f"cover it; give the {role} its own tokenizer (a cross-tokenizer teacher: Hydra "
                f"model.teacher.tokenizer=<folder or hub id>), or use a {role} of the student's family."
            )
    return min(known.values()) if known else None


def limit_output_rows(model: nn.Module, rows: int) -> bool:
    """Make ``model`` give logits for token ids ``[0, rows)`` only (its head becomes a ``SharedRangeHead``: exactly
    the model truncated to ``rows`` rows, its parameters untouched). Returns whether it changed anything. ValueError
    when the head is not a plain ``nn.Linear`` (a custom or adapter-wrapped head cannot be limited)."""
    current = vocab_size(model)
    if current is None or current == rows:
        return False
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if not isinstance(head, nn.Linear) or type(head) not in (nn.Linear, SharedRangeHead) or head.weight.shape[0] < rows:
        raise ValueError(
            f"Cannot limit {type(model).__name__}'s output to the {rows} vocabulary rows it shares with the other "
            f"models: its output projection is {type(head).__name__}, not a plain nn.Linear with at least {rows} "
            "rows. Use models with the same vocabulary size, or resize this one's embeddings "
            "(model.resize_token_embeddings) before passing it in."
        )
    head.__class__ = SharedRangeHead
    cast(SharedRangeHead, head).rows = rows
    return True


def source_vocab_size(source: ModelSource, *, role: str = "model") -> int | None:
    """The vocabulary size ``source`` will have once loaded, read without loading any weights: a module's output
    rows, a config's ``vocab_size``, or the ``config.json`` of a folder or hub id (the hub's small config file only;
    an unreachable hub id fails as ``load_causal_lm`` would). None when it cannot be told."""
    if isinstance(source, nn.Module):
        return vocab_size(source)
    if isinstance(source, Mapping) and isinstance(source.get("config"), Mapping) and "vocab_size" in source["config"]:
        return int(source["config"]["vocab_size"])
    config = source_config(source, role=role)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text_config, "vocab_size", None)
    return int(size) if size is not None else None


def source_config(source: ModelSource, *, role: str = "model") -> PretrainedConfig | None:
    """The config ``source`` will load with, read without loading any weights: a module's ``config``, a config (or
    a spec's), or the ``config.json`` of a folder or hub id (an unreachable hub id fails as ``load_causal_lm``
    would). None when it cannot be told."""
    if isinstance(source, nn.Module):
        own = getattr(source, "config", None)
        return own if isinstance(own, PretrainedConfig) else None
    config: Any = source
    trust_remote_code, revision = False, None
    if isinstance(source, Mapping):
        config = source.get("config")
        trust_remote_code = bool(source.get("trust_remote_code", False))
        revision = (source.get("init_kwargs") or {}).get("revision")
        if config is None:
            config = source.get("name_or_path")
        elif isinstance(config, Mapping):
            config = dict(config)
            if "model_type" not in config:
                return None
            config = AutoConfig.for_model(config.pop("model_type"), **config)
    if isinstance(config, (str, os.PathLike)):
        name = str(config)
        folder = Path(name).expanduser()
        if folder.is_dir():
            if not (folder / "config.json").is_file():
                return None
            name = str(folder)
        elif name.startswith((".", "/", "~")) or name.count("/") > 1:
            return None  # load_causal_lm raises the missing-folder error itself
        else:
            check_hub_id_reachable(role, name, revision)
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    return config if isinstance(config, PretrainedConfig) else None


def check_tokenizer_fits(tokenizer: Any, model_vocab_size: int | None, *, role: str = "student") -> None:
    """Every token id the tokenizer can produce must index a row of the model's embeddings: ``len(tokenizer)`` at
    most the model's vocabulary size (a larger model vocabulary, padded for speed, is normal). ValueError otherwise."""
    if model_vocab_size is None:
        return
    size = len(tokenizer)
    if size > model_vocab_size:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"The tokenizer ({name!r}) has {size} tokens but the {role}'s vocabulary has {model_vocab_size}: token "
            f"ids {model_vocab_size} and up would index past its embeddings. Use the {role}'s own tokenizer (Hydra: "
            "leave model.tokenizer null, it then comes from the student's folder or hub id), or a model whose "
            "vocabulary covers this tokenizer."
        )


def dtype_chosen(source: ModelSource) -> bool:
    """Whether a model source fixes its own dtype: a spec with a dtype other than ``auto``, or a built module in
    another dtype than float32. A float32 module is what ``from_pretrained`` and ``from_config`` give by default,
    so it is treated like a folder loaded with ``dtype: auto``."""
    if isinstance(source, nn.Module):
        return {p.dtype for p in source.parameters() if p.is_floating_point()} != {torch.float32}
    if isinstance(source, Mapping):
        init_kwargs = source.get("init_kwargs") or {}
        dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
        return dtype is not None and str(dtype) != "auto"
    return False


def load_frozen_causal_lm(source: ModelSource, *, role: str, trust_remote_code: bool = False) -> nn.Module:
    """A frozen helper model (teacher, reference): loaded like the trained one, in eval mode, no gradients. A spec
    shared with the trained model (DPO's ``reference: ${model.student}``) drops its ``lora`` entry: a frozen model
    gets no adapters, it is the base model."""
    if isinstance(source, Mapping) and source.get("lora"):
        source = {key: value for key, value in source.items() if key != "lora"}
    return freeze(load_causal_lm(source, trust_remote_code=trust_remote_code, role=role))


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on non-reentrant activation checkpointing (transformers >= 5.2x renamed
    ``gradient_checkpointing_enable``, now deprecated, to ``activation_checkpointing_enable``)."""
    name = "activation_checkpointing_enable"
    enable = getattr(model, name, None) or getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise ValueError(
            f"gradient_checkpointing=True needs a model with {name}() or gradient_checkpointing_enable() "
            f"(a Hugging Face PreTrainedModel); {type(model).__name__} has neither."
        )
    enable({"use_reentrant": False})
