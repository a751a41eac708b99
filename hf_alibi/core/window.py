"""The rotary window (``rotary_window``): a knee in query-key distance for the slow rotary dimensions a pretrained
conversion keeps.

A pretrained rotary model never saw a query-key distance of its original length ``L`` or more, and the rotary
frequencies of wavelength longer than ``L`` (``rotary_knee``) never completed a turn in training: past ``L`` they
meet angles they never saw. The rotary knee (``rotary_stretch``) slows them past an absolute position, which also
compresses the distances between neighbours there; ``rotary_interpolation`` slows them everywhere, which changes
the angles inside ``L``. The window slows them by distance instead: a pair of tokens at distance ``d < W`` (the
window) reads every angle as trained, a pair at ``d >= W`` reads the slowed dimensions at the distance
``W + (d - W) / stretch`` (ReRoPE's leaky form, Su 2023, on the slow dimensions only), and so does its ALiBi
penalty (``-slope * (W + (d - W) / stretch)``; sinks keep 0): far keys stay within reach, which found the passkey
where the penalty on the true distance did not (docs/pretrained.md). With ``W = L`` nothing changes inside the
original length; with ``W = L / 2`` (the ``long`` preset) the far half of it is read through the map too, which read
better on every text measured; past ``L``, neighbours keep their trained angles and far pairs stay close to them.

The angle between a query at position ``m`` and a key at ``n`` depends on ``m - n`` only, so the far pairs' angles
come from turning the already rotated query by ``m / stretch + c - m`` and key by ``n / stretch - n`` more
(``c = W (1 - 1 / stretch)``), which needs positions that count the row's tokens: the cache's slot order (:func:`
slopes.offsets`), a packed row's (its documents are separate, and within one both counts differ by a constant).

That is not one dot product per pair any more: a query meets near keys with one rotation and far keys with another.
:func:`window_attention` computes it with SDPA on keys laid out twice, each copy masked to its regime (``D +
slowed`` channels: the fast channels once, the slowed ones in both rotations), in chunks of queries, with the
layer's bias and transformers' mask merged as on the bias path (``mask.py``); only where the keys reach past the
window. Shorter calls run the model's usual path unchanged (the same math: no pair is far). Kernels that compute
the scores themselves (flash-attn, flex, cuDNN, FA4, vLLM, llama.cpp) cannot carry it: they refuse past the window
(:func:`kernels.window_refusal`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from .compat import is_exporting
from .mask import attends
from .slopes import offsets, sink_keys

HALVES, PAIRS = "halves", "pairs"  # rotate_half's layout (Llama), interleaved pairs (GPT-J, Cohere)
WINDOW = "window"  # the path name a layer records (``AlibiBias.last_path``) past its window
CHUNK = 1024  # queries per SDPA call past the window: an (H, CHUNK, keys) mask at a time
FAR = 1e30  # the distance a masked pair reads: its penalty (slopes > 0, at least 1e-8 here) is below any score


@dataclass(frozen=True, eq=False)
class RotaryWindow:
    """The rotary window of a model's layers: ``size`` (tokens), ``stretch``, the wavelength past which channels
    are slowed (``knee``) and the model's :class:`strategies.RetainedRotary` (``rotary``), whose probe, made in each
    forward before the layers run, gives the channels' frequencies: read then, not at conversion (a checkpoint's
    model is built on the meta device)."""

    size: int
    stretch: float
    knee: float
    rotary: object

    @property
    def frequencies(self) -> torch.Tensor:
        """float64 ``(width,)``: radians per token of the slowed channels (kept, wavelength > ``knee``) in the layout
        of the model's ``cos``/``sin``, 0 on the others; over a head's first ``width`` channels."""
        frequency, kept = self.rotary.frequency, self.rotary.kept
        if frequency is None:
            raise ValueError("The rotary window's layer ran before the model's rotary embedding: call the model.")
        slowed = kept & (frequency.abs() < 2 * math.pi / self.knee)
        return torch.where(slowed, frequency, torch.zeros_like(frequency)).double()

    def check_layout(self) -> None:
        """A one-line ``ValueError`` unless the rotary channels are laid out in halves or pairs (asked eagerly: a
        traced forward takes the layout from a tensor, :meth:`turn`)."""
        if rotary_layout(self.rotary.frequency) is None:
            raise ValueError(
                "The rotary window reads rotary channels laid out in halves (Llama) or pairs (GPT-J); this model's "
                "are neither: convert without rotary_window."
            )

    @property
    def offset(self) -> float:
        """``c``: a far pair at distance ``d`` reads ``d / stretch + c`` (continuous at ``d = size``)."""
        return self.size * (1 - 1 / self.stretch)

    def turn(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """``x`` (``(B, H, N, D)``) with its slowed channels turned ``shift`` (``(N,)``, float64) positions more."""
        frequencies = self.frequencies.to(shift.device)
        width = frequencies.shape[0]
        angle = shift[:, None] * frequencies[None, :]  # (N, width), 0 on channels left alone
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        rotary = x[..., :width]
        first, second = rotary.chunk(2, dim=-1)
        halves = torch.cat((-second, first), dim=-1)  # rotate_half's companion channels
        pairs = torch.stack((-rotary[..., 1::2], rotary[..., 0::2]), dim=-1).flatten(-2)  # interleaved pairs'
        frequency = self.rotary.frequency
        is_halves = (frequency[: width // 2] == frequency[width // 2 :]).all()  # a tensor: no branch while traced
        turned = torch.where(is_halves, halves, pairs)
        return torch.cat((rotary * cos + turned * sin, x[..., width:]), dim=-1)


def rotary_layout(frequency: torch.Tensor) -> str | None:
    """The layout of a rotary ``cos``/``sin`` row from its per-channel frequencies: ``"halves"`` (the first half's
    frequencies repeated), ``"pairs"`` (each repeated once in place), else ``None``.

    >>> rotary_layout(torch.tensor([1.0, 0.1, 1.0, 0.1])), rotary_layout(torch.tensor([1.0, 1.0, 0.1, 0.1]))
    ('halves', 'pairs')
    """
    width = frequency.shape[0]
    if width % 2:
        return None
    if torch.equal(frequency[: width // 2], frequency[width // 2 :]):
        return HALVES
    if torch.equal(frequency[0::2], frequency[1::2]):
        return PAIRS
    return None


def window_attention(module, query, key, value, attention_mask, alibi, forward, scaling, dropout: float = 0.0):
    """The attention of a layer whose keys reach past its rotary window, ``(B, q, H, D)`` as transformers' backends
    return it. ``query`` ``(B, H, q, D)`` and ``key``/``value`` ``(B, H_kv, kv, D)`` come rotated as trained;
    ``attention_mask`` is transformers' (``None``: causal), ``forward`` the :class:`forward.AlibiForward` (sinks'
    rows, a packed row's documents, a static cache's end)."""
    window: RotaryWindow = alibi.window
    batch, heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    starts, _ = forward.rows(alibi)
    end = forward.end  # recorded for every model with a window (conversion.py): a static cache's keys start at 0
    query_offset, key_offset = offsets(q_len, kv_len, end)
    if key_offset:
        raise ValueError(
            f"The rotary window needs the cache to hold every key from position 0 (a sliding cache holds the last "
            f"{kv_len}): convert without rotary_window for a model with sliding-window layers."
        )
    if key.shape[1] != heads:  # grouped-query attention: each query head's keys
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    size, stretch = window.size, window.stretch
    device = query.device
    slopes = alibi.fixed_slopes(device)
    key_positions = torch.arange(kv_len, device=device, dtype=torch.float64)
    key_columns = key_positions.float()
    if not is_exporting():
        window.check_layout()
    slowed = window.frequencies.to(device) != 0  # (width,)
    slow = torch.cat((slowed, slowed.new_zeros(dim - slowed.shape[0])))  # (D,): the channels past the rotary ones stay
    # (B, H, kv, 2D): near keys [k, 0], far keys [k's other channels, k's slowed channels turned], for queries [q, q's
    # slowed channels turned]: a fixed width (a traced graph has no data-dependent shapes), the slowed ones at 0
    far_keys = window.turn(key, key_positions / stretch - key_positions).masked_fill(~slow, 0)
    near = torch.cat((key, torch.zeros_like(far_keys)), dim=-1)
    far = torch.cat((key.masked_fill(slow, 0), far_keys), dim=-1)
    padded = torch.nn.functional.pad(value, (0, dim))
    masked = torch.finfo(query.dtype).min
    documents = forward.documents
    # what every head shares: each key's sink flag (the first real tokens of its row or document) and transformers'
    # mask (padding, a static cache's empty slots) as booleans; the bias is made from them per chunk in two passes
    sink = sink_keys(kv_len, alibi.sinks, starts, None, device)[:, 0, 0] if alibi.sinks else None  # (B|1, kv)
    allowed = None if attention_mask is None else attends(attention_mask)[:, 0]  # (B|1, q, kv)
    outputs = []
    for first in range(0, q_len, CHUNK):
        last = min(q_len, first + CHUNK)
        positions = torch.arange(query_offset + first, query_offset + last, device=device, dtype=torch.float64)
        rows = positions.float()
        chunk = query[:, :, first:last]
        far_query = window.turn(chunk, positions / stretch + window.offset - positions).masked_fill(~slow, 0)
        both = torch.cat((chunk, far_query), dim=-1)
        top = query_offset + last  # keys at or after it are in every row's future
        low = max(0, query_offset + first - size + 1)  # the near keys start here
        high = max(0, top - size)  # the far keys end here
        columns = partial(_columns, low=low, top=top, high=high)
        far_column = torch.arange(top - low + high, device=device) >= top - low
        distance = rows[:, None] - columns(key_columns)[None, :]  # (rows, columns): exact in float32 below 2^24
        regime = torch.where(far_column, distance >= size, (distance >= 0) & (distance < size))
        # a far pair reads its mapped distance, in its slowed angles and its penalty (-slope * distance); sinks 0;
        # a key a query may not see reads FAR (-slope * FAR: below any score, finite where a row sees nothing)
        read = torch.where(far_column, size + (distance - size) / stretch, distance)[None]  # (1, rows, columns)
        if sink is not None:
            read = read.masked_fill(columns(sink)[:, None, :], 0.0)
        keep = regime[None]
        if allowed is not None:
            keep = keep & columns(allowed[:, first:last, :top])
        if documents is not None:  # a packed row: each query sees its own document
            keep = keep & columns(documents[:, query_offset + first : top, None] == documents[:, None, :top])
        bias = -slopes[:, None, None] * read.masked_fill(~keep, FAR)[:, None]  # (B|1, H, rows, columns), one pass
        if bias.dtype != query.dtype:
            bias = bias.clamp_min(masked).to(query.dtype)
        keys = torch.cat((near[:, :, low:top], far[:, :, :high]), dim=2)
        values = torch.cat((padded[:, :, low:top], padded[:, :, :high]), dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(
            both, keys, values, attn_mask=bias, dropout_p=dropout, scale=scaling
        )
        outputs.append(out[..., :dim])
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _columns(x: torch.Tensor, low: int, top: int, high: int) -> torch.Tensor:
    # the near copy's keys (``low`` to ``top``), then the far copy's (0 to ``high``), on the last dimension
    return torch.cat((x[..., low:top], x[..., :high]), dim=-1)


def rotary_window(base, settings) -> RotaryWindow | None:
    """The window ``settings`` ask for (``rotary_window``) on ``base``'s one retained rotary embedding, else
    ``None``; a model with several rotary embeddings (per layer type) is refused in one line."""
    size = getattr(settings, "rotary_window", None)
    if size is None:
        return None
    from .strategies import RetainedRotary  # strategies imports torch modules this one does not need at import

    rotaries = [module for module in base.modules() if isinstance(module, RetainedRotary)]
    if len(rotaries) != 1:
        raise ValueError(
            f"rotary_window needs the model's one rotary embedding; {type(base).__name__} has {len(rotaries)} kept "
            "ones (one per layer type?): convert without rotary_window."
        )
    return RotaryWindow(int(size), float(settings.rotary_window_stretch), float(settings.rotary_knee), rotaries[0])
