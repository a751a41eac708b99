"""Sinks on vLLM's own kernels: the bias exemption of the first keys folded into extra query / key channels.

vLLM's attention adds ``m_h (j - i)`` to every causal score (query position i, key position j, each request's own
positions) and knows nothing of sinks, the first ``S`` keys of each request that hf_alibi leaves unpenalised. The
difference is ``m_h (i - j)`` on those keys alone, a product of a query term and a key term, so it can ride in
``q . k``: each key gets an indicator ``s_j = [j < S]`` and ``s_j j``, each query ``m_h i / scale`` and
``-m_h / scale`` (``scale``: the softmax scale vLLM multiplies ``q . k`` by), so that ``scale * q . k`` gains
``s_j m_h (i - j)`` exactly where vLLM's bias took it. The keys' channels go into the paged cache with the keys
(prefix caching and chunked prefill see them as any key); the values are zero-padded to the same head size, and the
extra output columns, zero, are dropped. In half precision each query term is split into three parts whose sum is
its fp32 value (the key channels are small integers, exact), as the sdpa fold does (``hf_alibi/core/folded.py``).

Pure torch, no vLLM: :mod:`hf_alibi.serve.vllm.model` calls it around vLLM's attention function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.folded import HALF_DTYPES, HALF_PARTS, half_parts
from .internals import HEAD_SIZES


def channels(dtype: torch.dtype) -> int:
    """How many channels the fold adds to each query / key head in ``dtype``."""
    return 2 * (HALF_PARTS if dtype in HALF_DTYPES else 1)


def padded_head_size(head_size: int, dtype: torch.dtype) -> int:
    """The smallest head size every vLLM backend that applies the slopes takes (:data:`internals.HEAD_SIZES`) that
    holds ``head_size`` and the fold's channels.

    >>> padded_head_size(64, torch.float32), padded_head_size(64, torch.bfloat16), padded_head_size(128, torch.float32)
    (80, 80, 160)
    """
    needed = head_size + channels(dtype)
    fits = [size for size in HEAD_SIZES if size >= needed]
    if not fits:
        raise ValueError(
            f"hf_alibi: a head of {head_size} with the sinks' channels needs {needed}, more than vLLM's largest head "
            f"size {HEAD_SIZES[-1]}: serve it in transformers (hf-alibi serve), or for vLLM convert the original "
            "again with slopes fitted without a sink: hf-alibi convert SRC OUT --preset pretrained --sinks 0 "
            "--fit-slopes --fit-text TEXT (not --sinks 0 alone: 10x the perplexity at 4k on SmolLM2-135M)."
        )
    return fits[0]


@dataclass(frozen=True)
class SinkFold:
    """What one layer's fold needs: its heads' slopes on this rank, the number of sinks, vLLM's softmax scale, the
    model's head size and the padded one."""

    slopes: tuple[float, ...]
    sinks: int
    scale: float
    head_size: int
    padded: int
    _slopes_on: dict = field(default_factory=dict, compare=False, repr=False)  # device -> the slopes (H, 1), fp32

    def slopes_on(self, device: torch.device) -> torch.Tensor:
        """The slopes as an fp32 ``(H, 1)`` tensor on ``device``, made once per device (every step reads them)."""
        kept = self._slopes_on.get(device)
        if kept is None:
            kept = self._slopes_on[device] = torch.tensor(self.slopes, dtype=torch.float32, device=device)[:, None]
        return kept


def fold(fold: SinkFold, query, key, value, positions):
    """``query`` (1, H, T, D), ``key`` / ``value`` (1, Hkv, T, D), ``positions`` (1, T) or (T,): each token's position
    in its request -> the three at head size ``fold.padded``, channels added (transformers' layout, as vLLM's
    attention function takes them)."""
    dtype, (_, heads, tokens, size) = query.dtype, query.shape
    positions = positions.reshape(-1).to(torch.float32)  # (T,)
    slopes = fold.slopes_on(query.device)  # (H, 1)
    sink = (positions < fold.sinks).to(torch.float32)  # (T,): s_j
    q_terms = [slopes * positions / fold.scale, (-slopes / fold.scale).expand(heads, tokens)]  # (H, T) each
    k_terms = [sink, sink * positions]  # (T,) each
    q_channels, k_channels = [], []
    for q_term, k_term in zip(q_terms, k_terms):
        parts = half_parts(q_term, dtype).unbind(-1)
        q_channels += parts
        k_channels += [k_term.to(dtype)] * len(parts)
    pad = fold.padded - size - len(q_channels)
    q_extra = torch.stack(q_channels, dim=-1)[None]  # (1, H, T, C)
    k_extra = torch.stack(k_channels, dim=-1)[None, None].expand(1, key.shape[1], tokens, len(k_channels))
    query = torch.nn.functional.pad(torch.cat([query, q_extra], dim=-1), (0, pad))
    key = torch.nn.functional.pad(torch.cat([key, k_extra.to(key.dtype)], dim=-1), (0, pad))
    value = torch.nn.functional.pad(value, (0, fold.padded - size))
    return query, key, value


def unfold(fold: SinkFold, output: torch.Tensor) -> torch.Tensor:
    """vLLM's attention output (T, H * padded) -> (T, H * head_size): the zero columns of the padded values dropped."""
    tokens = output.shape[0]
    return output.view(tokens, -1, fold.padded)[..., : fold.head_size].reshape(tokens, -1)
