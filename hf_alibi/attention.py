"""ALiBi attention for transformers v5's attention interface, for every backend in one place.

A patched model's config reports ``config._attn_implementation == "alibi_<backend>"`` (see
``config.py``), so transformers dispatches each attention layer to the function registered here
under that name. The function finds the layer's :class:`AlibiBias` (``module.alibi``), builds the
bias, merges it with the mask transformers made, and calls the backend. A layer without an
``AlibiBias`` (cross-attention) runs the backend unchanged: no position bias, as in T5.

Registering new names is all that happens at import: no transformers function is replaced, so
models that were not patched are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .slopes import BIAS_KINDS, LEARNED, alibi_bias, get_slopes

PREFIX = "alibi_"


class AlibiBias(nn.Module):
    """Per-layer ALiBi state: which bias form, how many heads, and the learned slopes if any.

    The fixed slopes are not buffers: they are recomputed in float32 per device, so that
    ``model.half()`` can never round them and a state dict is the same with or without ALiBi.
    Only the ``learned`` form owns parameters (``slopes_left`` / ``slopes_right``, before the
    ``-sigmoid``), which are saved with the model's weights.
    """

    def __init__(self, kind: str, num_heads: int):
        super().__init__()
        if kind not in BIAS_KINDS:
            raise ValueError(f"Unknown ALiBi bias kind {kind!r}; expected one of {BIAS_KINDS}.")
        self.kind = kind
        self.num_heads = num_heads
        if kind == LEARNED:
            self.slopes_left = nn.Parameter(torch.empty(num_heads))
            self.slopes_right = nn.Parameter(torch.empty(num_heads))
            self.reset_parameters()
        self._slopes_by_device: dict[torch.device, torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """The seed's initialisation of the learned slopes: normal(-2, 1) before the -sigmoid."""
        if self.kind == LEARNED:
            with torch.no_grad():
                self.slopes_left.normal_(-2.0, 1.0)
                self.slopes_right.normal_(-2.0, 1.0)

    def fixed_slopes(self, device: torch.device) -> torch.Tensor:
        slopes = self._slopes_by_device.get(device)
        if slopes is None:
            slopes = self._slopes_by_device[device] = get_slopes(self.num_heads, device=device)
        return slopes

    def forward(self, q_len: int, kv_len: int, device: torch.device, masked_value: float) -> torch.Tensor:
        """The bias with this layer's own masking (causal, nonsymmetric), fp32 ``(1, H, q, kv)``."""
        if self.kind == LEARNED:
            left = -torch.sigmoid(self.slopes_left.float())
            right = -torch.sigmoid(self.slopes_right.float())
            return alibi_bias(LEARNED, q_len, kv_len, left, slopes_right=right, masked_value=masked_value)
        return alibi_bias(self.kind, q_len, kv_len, self.fixed_slopes(device), masked_value=masked_value)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, num_heads={self.num_heads}"


def merge_bias_and_mask(bias: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One additive float mask in ``dtype`` from the fp32 bias and transformers' mask.

    ``attention_mask`` is what transformers' mask interface made: ``None``, a boolean mask
    (True = attend) or an additive float mask whose masked entries are ``finfo(dtype).min``.
    Masked entries come out as exactly ``finfo(dtype).min``: the sum is clamped, so a positive
    bias can never bring a masked key back, and a fully masked row stays finite.
    """
    masked_value = torch.finfo(dtype).min
    if attention_mask is None:
        merged = bias
    elif attention_mask.dtype == torch.bool:
        merged = torch.where(attention_mask, bias, masked_value)
    else:
        merged = (bias + attention_mask.float()).clamp_min(masked_value)
    return merged.to(dtype)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with an additive mask; softmax in float32. Shapes ``(B, H, L, D)``."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, q, kv)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, q, H, D)
    return output, weights


def _unsupported_backend(name: str) -> Callable:
    def forward(*args, **kwargs):
        raise NotImplementedError(
            f"hf_alibi has no ALiBi path for attn_implementation={name!r} yet. "
            f"Use one of {sorted(BACKENDS)}: model.set_attn_implementation('sdpa')."
        )

    return forward


# backend name -> (attention function, mask function); the attention function receives the
# merged float mask (bias + padding + causality) and never needs to know about ALiBi.
BACKENDS: dict[str, tuple[Callable, Callable]] = {
    "eager": (eager_attention_forward, AttentionMaskInterface._global_mapping["eager"]),
    "sdpa": (sdpa_attention_forward, AttentionMaskInterface._global_mapping["sdpa"]),
}
# transformers' names that hf_alibi knows of but cannot run with ALiBi yet: a clear error
# instead of transformers' "not a valid attention implementation".
UNSUPPORTED_BACKENDS = ("flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def alibi_name(backend: str | None) -> str | None:
    """``"sdpa"`` -> ``"alibi_sdpa"``; already prefixed names and ``None`` pass through."""
    if backend is None or backend.startswith(PREFIX):
        return backend
    return PREFIX + backend


def base_name(name: str | None) -> str | None:
    """``"alibi_sdpa"`` -> ``"sdpa"``."""
    if name is None:
        return None
    return name.removeprefix(PREFIX)


def make_alibi_attention(backend: Callable) -> Callable:
    """Wrap a backend so that it adds the layer's ALiBi bias to the mask it is given."""

    def alibi_attention_forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ):
        alibi: AlibiBias | None = getattr(module, "alibi", None)
        if alibi is None:  # cross-attention: no position bias
            return backend(module, query, key, value, attention_mask, **kwargs)
        if query.shape[1] != alibi.num_heads:
            raise ValueError(f"ALiBi was set up for {alibi.num_heads} heads but this layer computes {query.shape[1]}.")
        masked_value = torch.finfo(query.dtype).min
        bias = alibi(query.shape[2], key.shape[2], query.device, masked_value)  # (1, H, q, kv) fp32
        mask = merge_bias_and_mask(bias, attention_mask, query.dtype)
        kwargs.pop("is_causal", None)  # causality is in the mask now
        kwargs.pop("position_bias", None)
        return backend(module, query, key, value, mask, is_causal=False, **kwargs)

    return alibi_attention_forward


def register_backends() -> None:
    """Add ``alibi_<backend>`` to transformers' attention and mask interfaces (idempotent)."""
    for name, (attention, mask) in BACKENDS.items():
        AttentionInterface.register(alibi_name(name), make_alibi_attention(attention))
        AttentionMaskInterface.register(alibi_name(name), mask)
    for name in UNSUPPORTED_BACKENDS:
        if alibi_name(name) not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(alibi_name(name), _unsupported_backend(name))
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
        if mask is not None and alibi_name(name) not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(alibi_name(name), mask)
