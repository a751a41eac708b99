"""``patch_model``: convert a transformers model to ALiBi, in place."""

from __future__ import annotations

from transformers import PreTrainedModel

from .core.config import AlibiSettings, get_settings, is_alibi_config
from .core.modeling import convert
from .core.slopes import ENCODER_VARIANTS, SYMMETRIC
from .registry import alibi_classes, get_architecture


def is_alibi_model(model: PreTrainedModel) -> bool:
    """True when ``model`` was converted by hf_alibi (or loaded from such a checkpoint)."""
    return is_alibi_config(model.config)


def patch_model(
    model: PreTrainedModel,
    heads: int | None = None,
    encoder_variant: str | None = None,
) -> PreTrainedModel:
    """Convert ``model`` to ALiBi in place and return it.

    The position path is removed (GPT-2's ``wpe``, a rotary embedding, BERT's table, T5's relative
    bias: inputs of any length run, position ids are ignored) and every self-attention layer adds the
    ALiBi bias through transformers' attention interface, for the backend the model uses (``eager``,
    ``sdpa``, ``flex_attention``, ``flash_attention_2``). Only this instance changes: its class
    becomes ``Alibi<Class>`` and its config ``Alibi<Config>`` with ``config.alibi``, so
    ``save_pretrained`` writes ``model_type="alibi_<type>"`` and, after ``import hf_alibi``,
    ``AutoModel*.from_pretrained`` rebuilds the same model. Every weight that is not removed is kept.

    Args:
        model: a model of a registered architecture (:func:`hf_alibi.supported_model_types`).
        heads: number of attention heads; must equal the config's (checked, since slopes are
            computed for it). Defaults to the config's.
        encoder_variant: bias of bidirectional self-attention (``"symmetric"``, the default;
            ``"nonsymmetric"``; ``"learned"``). An error for decoder-only models.

    Raises:
        ValueError: unsupported architecture, wrong ``heads``, an encoder variant for a
            decoder-only model, or a model that is already ALiBi (patching twice is an error, so
            that a second call with other settings can never be silently ignored). The model is
            left untouched when this raises.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> import hf_alibi
        >>> model = hf_alibi.patch_model(GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32)))
        >>> model.config.model_type
        'alibi_gpt2'
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}.")
    config = model.config
    if is_alibi_config(config):
        raise ValueError(
            f"This model is already an ALiBi model ({get_settings(config)}); patch_model converts a "
            "model once. Load the original checkpoint again to convert it with other settings."
        )
    row = get_architecture(config.model_type)
    config_heads = config.num_attention_heads
    if heads is None:
        heads = config_heads
    if heads != config_heads:
        raise ValueError(
            f"heads={heads} does not match the model's {config_heads} attention heads "
            f"(config.num_attention_heads); ALiBi needs one slope per head. Pass heads={config_heads} or omit it."
        )
    if row.bidirectional:
        encoder_variant = SYMMETRIC if encoder_variant is None else encoder_variant
        if encoder_variant not in ENCODER_VARIANTS:
            raise ValueError(f"encoder_variant must be one of {ENCODER_VARIANTS}, got {encoder_variant!r}.")
    elif encoder_variant is not None:
        raise ValueError(
            f"encoder_variant={encoder_variant!r} applies to bidirectional attention only; "
            f"{config.model_type} is decoder-only, its self-attention is causal. Omit encoder_variant."
        )
    classes = alibi_classes(config.model_type)
    alibi_cls = classes.get(type(model))
    if alibi_cls is None:
        raise ValueError(
            f"hf_alibi has no ALiBi class for {type(model).__name__}; for model_type {config.model_type!r} "
            f"it converts: {', '.join(sorted(cls.__name__ for cls in classes))}."
        )
    settings = AlibiSettings(
        base_model_type=config.model_type, heads=heads, encoder_variant=encoder_variant, architecture=row.to_dict()
    )
    # Everything is validated: from here on the instance changes (its config becomes a copy).
    convert(model, settings, row, alibi_cls)
    return model
