"""Slopes that fit a pretrained model: per layer and head, from how far the original's heads look on text.

A pretrained model's heads differ: some read the previous few tokens, others look hundreds back. The paper's
geometric slopes (or a uniform scale of them) give every layer the same penalties. :func:`fit_slopes` runs the
ORIGINAL model (before conversion) on the user's text with eager attention, measures each head's mean attention
distance ``D`` (the attention-weighted ``|i - j|`` over the keys that are not sinks, averaged over queries), and
gives it the slope ``scale / D``: a head that looked far gets a small penalty, a local head a steep one. The
lists go to ``patch_model(model, slopes=...)`` (one list per layer) and are saved in ``config.alibi``.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import PreTrainedModel

from ..core.architectures import find_architecture
from ..core.compat import attn_implementation
from ..core.conversion import self_attentions
from ..core.names import is_alibi
from ..core.partitions import whole_weights
from ..core.settings import FittedSlopes

DEFAULT_SCALE = 0.1  # SmolLM2-135M, no training: 0.1 beat 0.3 and 1.0 at 256 / 1024 / 4096 (docs/measurements.md)


@torch.no_grad()
def fit_slopes(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    scale: float = DEFAULT_SCALE,
    sinks: int = 1,
    skip: int | None = None,
) -> list[list[float]]:
    """Per-layer, per-head ALiBi slopes ``scale / D`` from the original ``model``'s attention on ``input_ids``.

    Args:
        model: the original model (not converted): a decoder-only or encoder row of the registry. It runs once
            with eager attention (its attention implementation is given back afterwards); its weights are
            untouched. Each layer's attention map is reduced as the layer runs: the memory is one layer's
            ``heads x T^2`` map (and eager attention's own), not the model's.
        input_ids: ``(T,)`` or ``(B, T)`` token ids of the user's text, no padding; ``T`` at most the model's
            trained length (a thousand tokens fit it inside that length; ``FIT_TOKENS``, 4096, read further past it
            on SmolLM2, docs/pretrained.md).
        scale: the slope of a head whose mean distance is ``D`` tokens is ``scale / max(D, 1)``.
        sinks: the first keys of each sequence left out of the distances (use the ``sinks`` you convert with).
        skip: queries before this position are left out (decoders: their short past shortens every distance);
            default ``T // 16`` for decoders, 0 for encoders.

    Returns:
        One list of ``heads`` slopes per self-attention layer, in the model's order:
        ``patch_model(model, preset="pretrained", slopes=fit_slopes(model, ids))``.

    Raises:
        ValueError: a converted model, an encoder-decoder or unregistered architecture, or bad arguments.

    Example:
        >>> ids = tokenizer(my_text, return_tensors="pt", truncation=True, max_length=1024)["input_ids"]
        >>> slopes = hf_alibi.fit_slopes(model, ids)  # doctest: +SKIP
        >>> hf_alibi.patch_model(model, preset="pretrained", slopes=slopes)  # doctest: +SKIP
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"fit_slopes expects a transformers PreTrainedModel, got {type(model).__name__}.")
    if is_alibi(model):
        raise ValueError("fit_slopes measures the ORIGINAL model's attention: pass the model before patch_model.")
    config = model.config
    row = find_architecture(config.model_type)
    if row is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"fit_slopes supports the registered decoder-only and encoder models, not {config.model_type!r}: "
            "use slope_scale instead."
        )
    if not (isinstance(scale, (int, float)) and scale > 0) or not (isinstance(sinks, int) and sinks >= 0):
        raise ValueError(f"scale must be > 0 and sinks an integer >= 0, got scale={scale!r}, sinks={sinks!r}.")
    ids = torch.as_tensor(input_ids).long()
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] <= sinks + 1:
        raise ValueError(f"input_ids must be (T,) or (B, T) with T > sinks + 1 tokens, got shape {tuple(ids.shape)}.")
    bidirectional = row.bidirectional and not getattr(config, "is_decoder", False)
    length = ids.shape[1]
    skip = (0 if bidirectional else length // 16) if skip is None else skip
    if not 0 <= skip < length:
        raise ValueError(f"skip must be between 0 and the {length} tokens given, got {skip}.")

    positions = torch.arange(length)
    distance = (positions[:, None] - positions[None]).abs().float()[skip:, sinks:]  # (T - skip, T - sinks): |i - j|
    attentions = self_attentions(model.base_model, row)
    means: list[torch.Tensor | None] = [None] * len(attentions)

    def reduce(index: int, _module, _args, output) -> None:
        """One layer's mean distance per head, taken from its eager attention weights as it runs (no layer's map
        is kept: the memory is one layer's, not the model's)."""
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(weights, torch.Tensor) and weights.dim() == 4:
            weights = weights.float()[..., skip:, sinks:]
            kept = weights.sum(-1).clamp(min=1e-12)
            means[index] = ((weights * distance.to(weights.device)).sum(-1) / kept).mean(dim=(0, 2)).cpu()  # (H,)

    previous = attn_implementation(config)
    was_training = model.training
    hooks = [module.register_forward_hook(partial(reduce, i)) for i, module in enumerate(attentions)]
    model.set_attn_implementation("eager")
    try:
        with whole_weights(model, "fit_slopes", forward=True):  # a ZeRO-3 partition gathered; the meta device refused
            model.eval()(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
        model.set_attn_implementation(previous)
        model.train(was_training)
    if any(mean is None for mean in means):
        raise ValueError(
            f"{config.model_type}: its attention layers gave no attention weights with eager attention, so "
            "fit_slopes cannot measure them. Use slope_scale instead."
        )
    return FittedSlopes([scale / max(d, 1.0) for d in mean.tolist()] for mean in means)
