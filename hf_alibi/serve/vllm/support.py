"""What vLLM can carry of a converted model, and what the plugin tells it: the refusals, each tensor-parallel rank's
slopes, the architecture names (no vLLM import: the default test tier reads these)."""

from __future__ import annotations

from ...core.compat import auto_class_names
from ...core.names import is_alibi

# vLLM's own default for a model whose config states no length (config/model.py, _get_and_verify_max_len)
DEFAULT_MAX_MODEL_LEN = 2048
SERVED = "vLLM serves converted causal language models (the AutoModelForCausalLM class of their type)"


def refusal(config) -> str | None:
    """Why vLLM cannot serve the converted model of ``config`` (a converted ``PretrainedConfig``), in one line, or
    None where it can."""
    if not is_alibi(config):
        return f"{type(config).__name__} is not a converted ALiBi config: {SERVED}."
    alibi = config.alibi
    name = (getattr(config, "architectures", None) or [None])[0]  # None: a config made in memory, not saved yet
    causal_lm = auto_class_names(alibi.get("base_model_type", "")).get("AutoModelForCausalLM")
    if alibi.get("encoder_variant") is not None or (name is not None and name != f"Alibi{causal_lm}"):
        return f"{name or type(config).__name__} is not a causal language model: {SERVED}; run it in transformers."
    name = name or type(config).__name__
    if alibi.get("rotary_window") is not None:
        return (
            f"{name} reads its far query-key pairs with another rotation (rotary_window), which vLLM's kernels do not "
            "compute: run it in transformers (`hf-alibi serve`), or convert without rotary_window."
        )
    if getattr(config, "attn_logit_softcapping", None):
        return (
            f"{name} soft-caps its attention scores, and where vLLM's kernels add the ALiBi bias relative to the cap "
            "is unchecked: run it in transformers (`hf-alibi serve`)."
        )
    return None


def check(config) -> None:
    """:func:`refusal` as a one-line ``ValueError``."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(f"hf_alibi: {reason}")


def rank_slopes(slopes: tuple[float, ...], heads: int, rank: int) -> list[float]:
    """The slopes of tensor-parallel rank ``rank``'s ``heads`` query heads: vLLM gives rank r heads
    ``r * heads .. (r + 1) * heads - 1`` (its column-parallel query projection splits the heads in order).

    >>> rank_slopes((0.5, 0.25, 0.125, 0.0625), 2, 1)
    [0.125, 0.0625]
    """
    if heads * (rank + 1) > len(slopes):
        raise ValueError(f"rank {rank} with {heads} heads each needs {heads * (rank + 1)} slopes, the layer has "
                         f"{len(slopes)}")  # fmt: skip
    return list(slopes[rank * heads : (rank + 1) * heads])


def converted_architectures() -> list[str]:
    """Every class name a converted checkpoint's config.json can name (``Alibi<Class>`` for each built-in row's
    transformers classes), sorted.

    >>> "AlibiLlamaForCausalLM" in converted_architectures()
    True
    """
    from ...convert.registry import supported_model_types

    return sorted({"Alibi" + name for kind in supported_model_types() for name in auto_class_names(kind).values()})
