"""ALiBi math in pure torch: slopes and the bias forms. Imports nothing from transformers.

The bias a head ``h`` adds to the score of query ``i`` and key ``j`` is ``-m_h * d(i, j)``:

* causal:        ``d = i - j`` for ``j <= i``; keys after the query are masked.
* symmetric:     ``d = |i - j|`` (bidirectional encoders).
* nonsymmetric:  ``d = |i - j|``; the first half of the heads sees only ``j <= i``, the second
  half only ``j >= i``.
* learned:       ``slope_left * (i - j)`` for ``j <= i``, ``slope_right * (j - i)`` otherwise, with
  per-head slopes ``-sigmoid(parameter)`` (they are passed in already negative).

Every form is built in float32 and returns masked positions as ``masked_value`` (never ``-inf``,
so that a fully masked row stays finite), shaped ``(1, H, q_len, kv_len)``.

A causal bias may be rounded per key (:class:`KeyRounding`, Falcon's code): ``t(p_j) - t(p_i)`` with ``t(p) =
factor * round(m' * p)``; every kernel renders it from :meth:`KeyRounding.terms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .names import BIAS_KINDS, CAUSAL, ENCODER_VARIANTS, LEARNED, NONSYMMETRIC, SYMMETRIC  # noqa: F401  (re-exported)


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]


def get_slopes_list(n_heads: int) -> list[float]:
    """The paper's slopes in head order, as Python floats.

    For a power of two ``n`` the slopes are ``2^(-8h/n)``, ``h = 1..n``. Otherwise, with ``c`` the
    largest power of two below ``n``: ``slopes(c) + slopes(2c)[0::2][: n - c]`` (fairseq's
    ``get_slopes``).

    >>> get_slopes_list(6)
    [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    """
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ValueError(f"ALiBi needs a positive integer number of heads, got {n_heads!r}.")
    if math.log2(n_heads).is_integer():
        return _power_of_two_slopes(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return _power_of_two_slopes(closest) + _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]


def get_slopes(n_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The paper's slopes as a float32 tensor of shape ``(n_heads,)``.

    >>> get_slopes(8)
    tensor([0.5000, 0.2500, 0.1250, 0.0625, 0.0312, 0.0156, 0.0078, 0.0039])
    """
    return torch.tensor(get_slopes_list(n_heads), dtype=torch.float32, device=device)


def offsets(q_len: int, kv_len: int, end: int | None = None) -> tuple[int, int]:
    """Where a call's queries and keys sit in the sequence, the one place that says it: query ``r`` at position
    ``query_offset + r``, key ``j`` at ``key_offset + j``. The queries are the last ``q_len`` of the sequence's ``end``
    positions (default: ``kv_len``, a cache holding the earlier ones); a static cache holds more slots than tokens
    (``kv_len > end``: its keys start at 0), a sliding cache fewer (``kv_len < end``: at ``end - kv_len``).

    >>> offsets(1, 8, end=5), offsets(1, 4, end=10), offsets(3, 6)
    ((4, 0), (9, 6), (3, 0))
    """
    end = kv_len if end is None else end
    return end - q_len, max(0, end - kv_len)


def relative_distance(
    q_len: int, kv_len: int, device: torch.device | str | None = None, end: int | None = None
) -> torch.Tensor:
    """``i - j`` as float32, shape ``(q_len, kv_len)``.

    The queries are the last ``q_len`` of the ``kv_len`` positions (a KV cache holds the earlier
    ones), so query row ``r`` sits at absolute position ``kv_len - q_len + r``. ``end`` (the
    sequence's true length so far, where known) places them at ``end - q_len + r`` instead: a static
    cache holds more slots than tokens (``kv_len > end``), a sliding cache fewer (``kv_len < end``:
    key ``j`` is then at ``end - kv_len + j``). Without sinks a constant shift per query changes
    nothing (softmax ignores it); with sinks the true positions matter.
    """
    if q_len > kv_len:
        raise ValueError(f"ALiBi expects at least as many keys as queries, got q_len={q_len}, kv_len={kv_len}.")
    query_offset, key_offset = offsets(q_len, kv_len, end)
    query_pos = torch.arange(q_len, device=device, dtype=torch.float32) + query_offset
    key_pos = torch.arange(kv_len, device=device, dtype=torch.float32) + key_offset
    return query_pos[:, None] - key_pos[None, :]  # (q, kv)


def is_sink(key_positions: torch.Tensor, starts, sinks: int) -> torch.Tensor:
    """The sink test, the one place that says it: a key is a sink when it is one of the first ``sinks`` real tokens of
    its row (document, request), ``starts <= position < starts + sinks`` (positions as :func:`offsets` places them,
    ``starts`` broadcast against them). Every kernel asks it (:func:`sink_keys`, flex's score_mod, the paged bias)."""
    return (key_positions >= starts) & (key_positions < starts + sinks)


def sink_keys(
    kv_len: int, sinks: int, starts: torch.Tensor | None, end: int | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Which keys are sinks, bool ``(B or 1, 1, 1, kv_len)``: the first ``sinks`` real tokens of each row.

    ``starts`` (``(B,)``, or ``None`` for 0) is where each row's real tokens begin (left padding), or
    ``(B|1, kv_len)``: where each key's document begins (a packed row, see ``packing.py``);
    key ``j`` sits at absolute position ``j + max(0, end - kv_len)`` (see :func:`relative_distance`).

    >>> sink_keys(4, 2, torch.tensor([0, 1]), None)[:, 0, 0]
    tensor([[ True,  True, False, False],
            [False,  True,  True, False]])
    """
    key_pos = torch.arange(kv_len, device=device) + offsets(0, kv_len, end)[1]
    starts = torch.zeros(1, dtype=torch.long, device=device) if starts is None else starts.to(device)
    starts = starts[:, None] if starts.dim() == 1 else starts  # (B, 1), or (B|1, kv) per key
    return is_sink(key_pos, starts, sinks)[:, None, None, :]


def scaled_slopes_list(n_heads: int, slope_scale: float = 1.0, slopes: list | None = None) -> list:
    """The slopes a converted model uses: ``slopes`` where given (one per head, or one list per layer),
    else the paper's times ``slope_scale``.

    >>> scaled_slopes_list(2, 0.5)
    [0.03125, 0.001953125]
    """
    if slopes is not None:
        return [scaled_slopes_list(n_heads, 1.0, s) if isinstance(s, (list, tuple)) else float(s) for s in slopes]
    return [s * slope_scale for s in get_slopes_list(n_heads)]


@dataclass(frozen=True)
class KeyRounding:
    """A causal bias computed per key position and rounded, as Falcon's code does: the bias of query ``i`` on key
    ``j`` is ``t(p_j) - t(p_i)`` with ``t(p) = factor * round(m' * round(p))``, ``m' = round(slope / factor)``, each
    rounded to ``dtype``, and ``p`` a token's position counted from its row's (document's, request's) first real token
    (torch's ``bf16_tensor * int_tensor`` rounds the integers to bf16 first: 1023 becomes 1024).
    Softmax ignores ``t(p_i)``, a constant per query; ``t`` is linear (the plain bias) wherever ``m' * p`` is exact in
    ``dtype``: for bf16 up to 256 tokens with power-of-two slopes, and not at all for other slopes.

    Falcon-RW: ``dtype="bfloat16"`` (``slopes.bfloat16() * positions``) and ``factor`` its ``1/sqrt(head_dim)``,
    the scaling its bias is added before (the slopes a layer holds are ``m' * factor``).

    >>> KeyRounding("bfloat16", 1.0).terms(torch.tensor([0.5, 0.8]), torch.tensor([300.0]))
    tensor([[150.],
            [240.]])
    """

    dtype: str
    factor: float = 1.0

    def terms(self, slopes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``t(p)`` for every head: ``(H, *positions.shape)``, in fp32 (fp64 for fp64 positions)."""
        rounding = getattr(torch, self.dtype)
        exact = torch.promote_types(positions.dtype, torch.float32)
        raw = (slopes.double() / self.factor).to(rounding).float()  # m': the slope the model's code rounds
        # as torch multiplies a bf16 tensor by an integer one: the positions rounded to bf16 too, the product (exact
        # in fp32: two 8-bit significands) rounded once
        positions = positions.float().clamp(min=0).to(rounding).float()
        product = (raw.view(-1, *(1,) * positions.dim()) * positions).to(rounding)
        return product.to(exact) * self.factor


def check_rounding(kind: str, sinks: int) -> None:
    """One-line ``ValueError`` where a bias rounded per key (:class:`KeyRounding`) is asked of a form it does not
    describe: it is causal and has no sinks."""
    if kind != CAUSAL or sinks:
        raise ValueError("A bias rounded per key (KeyRounding) is causal and has no sinks.")


@dataclass(frozen=True)
class BiasSpec:
    """What one ALiBi layer adds, as one hashable value: its form (``kind``), its fixed slopes (one per head; the
    learned form's live in the layer's parameters, the paper's stand here), ``sinks`` (the first real keys of each
    row carry no bias) and ``rounding`` (:class:`KeyRounding`, or ``None``). Two layers with equal specs add the same
    bias wherever they see the same tokens: the value is the key under which a forward's merged masks are shared
    (``mask.py``, ``batching.py``), so a field added here reaches every cache.

    >>> BiasSpec("causal", (0.5, 0.25)) == BiasSpec("causal", (0.5, 0.25), sinks=0)
    True
    """

    kind: str
    slopes: tuple[float, ...]
    sinks: int = 0
    rounding: KeyRounding | None = None

    def __post_init__(self):
        if self.kind not in BIAS_KINDS:
            raise ValueError(f"Unknown ALiBi bias kind {self.kind!r}; expected one of {BIAS_KINDS}.")
        if self.rounding is not None:
            check_rounding(self.kind, self.sinks)

    @property
    def plain(self) -> bool:
        """Whether the bias is ``-m |i - j|`` alone (no sinks, no rounding): placed by no row start."""
        return not self.sinks and self.rounding is None

    @property
    def paper_slopes(self) -> bool:
        """Whether the slopes are the paper's for this many heads (:func:`get_slopes_list`), not fitted or set: equal
        to float64 rounding, since others compute the same powers of two another way (MPT's ``2^(-h * 8 / n2)``
        differs from the paper's ``start ** h`` in the last bit for 12 heads) and a kernel that writes the paper's
        slopes itself (cuDNN's, in fp32) renders those exactly as well.

        >>> BiasSpec("causal", (0.0625, 0.00390625)).paper_slopes, BiasSpec("causal", (0.5, 0.25)).paper_slopes
        (True, False)
        """
        paper = get_slopes_list(len(self.slopes))
        return all(math.isclose(m, p, rel_tol=1e-12, abs_tol=0.0) for m, p in zip(self.slopes, paper))


def row_positions(
    q_len: int, kv_len: int, starts: torch.Tensor | None, end: int | None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's and key's position counted from its row's first real token (:class:`KeyRounding`'s ``p``),
    float32 ``(B|1, q)`` and ``(B|1, kv)``. ``starts`` as :func:`sink_keys` takes it (``(B,)`` row starts, or
    ``(B|1, kv)`` each key's document start); ``end`` places the queries as :func:`relative_distance` does.

    >>> row_positions(2, 4, torch.tensor([0, 1]), None)[1]
    tensor([[ 0.,  1.,  2.,  3.],
            [-1.,  0.,  1.,  2.]])
    """
    query_offset, key_offset = offsets(q_len, kv_len, end)
    key_pos = torch.arange(kv_len, device=device) + key_offset
    query_pos = torch.arange(q_len, device=device) + query_offset
    if starts is None:
        return query_pos[None].float(), key_pos[None].float()
    starts = starts.to(device)
    if starts.dim() == 1:
        return (query_pos - starts[:, None]).float(), (key_pos - starts[:, None]).float()
    query_starts = starts[:, (query_pos - key_offset).clamp(min=0)]  # per key: a query is one of the keys
    return (query_pos - query_starts).float(), (key_pos - starts).float()


def alibi_bias(
    kind: str,
    q_len: int,
    kv_len: int,
    slopes: torch.Tensor,
    *,
    slopes_right: torch.Tensor | None = None,
    masked_value: float = torch.finfo(torch.float32).min,
    sinks: int = 0,
    starts: torch.Tensor | None = None,
    end: int | None = None,
    rounding: KeyRounding | None = None,
) -> torch.Tensor:
    """The additive ALiBi bias of one attention layer, float32, shape ``(1, H, q_len, kv_len)``.

    ``slopes`` are positive for the fixed forms (the bias is ``-slope * distance``); for ``learned``
    they are the (negative) left slopes and ``slopes_right`` the right ones, as in the seed's
    ``-sigmoid(parameter)`` parametrisation, and the bias is ``slope * distance``.
    ``sinks > 0``: the first ``sinks`` real keys of each row (from ``starts``, see :func:`sink_keys`)
    get bias 0 wherever they may be seen; the result is then ``(B, H, q, kv)`` when ``starts`` is given.
    ``end``: the queries' true end position (see :func:`relative_distance`).
    ``rounding`` (causal only, no sinks): the bias rounded per key (:class:`KeyRounding`), ``(B|1, H, q, kv)`` with
    each row's positions counted from ``starts``.

    >>> alibi_bias("symmetric", 3, 3, torch.tensor([0.5]))[0, 0]
    tensor([[-0.0000, -0.5000, -1.0000],
            [-0.5000, -0.0000, -0.5000],
            [-1.0000, -0.5000, -0.0000]])
    """
    if kind not in BIAS_KINDS:
        raise ValueError(f"Unknown ALiBi bias kind {kind!r}; expected one of {BIAS_KINDS}.")
    distance = relative_distance(q_len, kv_len, device=slopes.device, end=end)  # (q, kv), i - j
    if rounding is not None:
        check_rounding(kind, sinks)
        query_pos, key_pos = row_positions(q_len, kv_len, starts, end, device=slopes.device)
        keys, queries = rounding.terms(slopes, key_pos), rounding.terms(slopes, query_pos)  # (H, B|1, kv), (H, B|1, q)
        bias = (keys[:, :, None, :] - queries[:, :, :, None]).transpose(0, 1)  # (B|1, H, q, kv)
        return bias.masked_fill(distance < 0, masked_value)
    slopes = slopes.float()[:, None, None]  # (H, 1, 1)
    if kind == LEARNED:
        if slopes_right is None:
            raise ValueError("The learned ALiBi bias needs both left and right slopes.")
        right = slopes_right.float()[:, None, None]
        bias = torch.where(distance >= 0, slopes * distance, right * -distance).unsqueeze(0)
    else:
        bias = (-slopes * distance.abs()).unsqueeze(0)  # (1, H, q, kv)
    if sinks:
        bias = bias.masked_fill(sink_keys(kv_len, sinks, starts, end, device=bias.device), 0.0)  # (B|1, H, q, kv)
    if kind == CAUSAL:
        bias = bias.masked_fill(distance < 0, masked_value)
    elif kind == NONSYMMETRIC:
        n_heads = bias.shape[1]
        half = n_heads // 2
        sees_left = torch.arange(n_heads, device=bias.device)[:, None, None] < half  # (H, 1, 1)
        allowed = torch.where(sees_left, distance >= 0, distance <= 0)
        bias = bias.masked_fill(~allowed, masked_value)
    return bias


def mpt_slopes_list(n_heads: int, bias_max: float = 8.0) -> list[float]:
    """MPT's slopes (MosaicML's ``gen_slopes``, transformers' ``build_mpt_alibi_tensor``), as Python floats.

    ``m_h = 2^(-h * bias_max / n2)`` for ``h = 1..n2``, ``n2`` the next power of two ``>= n_heads``; for a head
    count that is not a power of two the list is reordered ``odd positions, then even ones`` and cut to ``n_heads``:
    with ``bias_max = 8`` that is the paper's interleave, so the paper's slopes for any head count (to float64
    rounding: the last bit may differ, :attr:`BiasSpec.paper_slopes` allows it); other ``bias_max``, other slopes.

    >>> mpt_slopes_list(6)
    [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    """
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ValueError(f"ALiBi needs a positive integer number of heads, got {n_heads!r}.")
    n2 = 2 ** math.ceil(math.log2(n_heads))
    slopes = [2.0 ** (-h * bias_max / n2) for h in range(1, n2 + 1)]
    return (slopes[1::2] + slopes[::2])[:n_heads] if n2 != n_heads else slopes
