"""``ValidationSettings``: what a method's validation generates and scores besides its loss (every method's
``validation`` group; Hydra ``method.validation.*``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_gkd.evaluation.metrics import GenerationMetric


@dataclass(frozen=True)
class ValidationSettings:
    """Generation metrics over greedy completions of the validation prompts (``fn(predictions, references) ->
    float``, logged as ``val/<name>``, scored against the dataset completions once per validation epoch) and the
    length of those completions (also the length guard's and the sample table's). Checked when made."""

    #: name -> metric; empty (or None, as Hydra's ``method.validation.metrics=null``): the loss alone. A name mapped to
    #: None is left out (an experiment's config drops a default metric so: ``accuracy: null``).
    metrics: Mapping[str, GenerationMetric] = field(default_factory=dict)
    #: The longest greedy completion, in new tokens (>= 1).
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", {k: v for k, v in (self.metrics or {}).items() if v is not None})
        if not_callable := sorted(str(name) for name, metric in self.metrics.items() if not callable(metric)):
            raise TypeError(
                f"validation.metrics: {', '.join(not_callable)} must be callables fn(predictions, references) -> "
                "float (Hydra: a _target_ with _partial_: true)."
            )
        tokens = self.max_new_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"validation.max_new_tokens must be an integer >= 1, got {tokens!r}.")
