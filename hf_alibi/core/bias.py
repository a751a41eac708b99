"""The per-layer ALiBi module (:class:`AlibiBias`) and the choice of how the sdpa backend applies it."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .compat import is_exporting
from .forward import SharedByLayers
from .mask import decoding_row
from .slopes import BIAS_KINDS, CAUSAL, LEARNED, BiasSpec, KeyRounding, alibi_bias, get_slopes_list, offsets

# How the sdpa backend applies the bias (see ``dispatch.choose_path``): "folded" puts the causal bias
# into extra q/k channels and keeps SDPA's causal kernel (no L x L tensor); "bias" builds the bias
# tensor and hands SDPA one float mask. "auto" takes "folded" wherever it is exact.
AUTO, FOLDED, BIAS = "auto", "folded", "bias"
PATHS = (AUTO, FOLDED, BIAS)


class AlibiBias(nn.Module):
    """Per-layer ALiBi state: which bias form, how many heads, and the learned slopes if any.

    The fixed slopes are not buffers: they are recomputed in float32 per device, so that
    ``model.half()`` can never round them and a state dict is the same with or without ALiBi.
    Only the ``learned`` form owns parameters (``slopes_left`` / ``slopes_right``, before the
    ``-sigmoid``), which are saved with the model's weights.

    ``path`` picks how the sdpa backend applies the bias: ``"auto"`` (default; the environment
    variable ``HF_ALIBI_PATH`` can override it), ``"folded"`` or ``"bias"``.
    ``last_path`` records the path the latest call took ("folded", "bias", "flex" or "flash").
    ``shared`` is what the layers of one model share (:class:`forward.SharedByLayers`: the decoding rows; one per
    model, made by the conversion; a layer built on its own gets its own).
    ``slopes`` (the fixed forms' slopes, one per head; default the paper's) and ``sinks`` (the first
    ``sinks`` real keys of each row carry no penalty; the row starts are the forward's, ``forward.AlibiForward``)
    are the settings of ``AlibiSettings`` of those names. ``window``: the layer's rotary window
    (:class:`window.RotaryWindow`, set by the conversion with ``rotary_window``), else ``None``.

    >>> AlibiBias("causal", 4)
    AlibiBias(kind='causal', num_heads=4, path='auto')
    """

    def __init__(
        self,
        kind: str,
        num_heads: int,
        path: str = AUTO,
        shared: SharedByLayers | None = None,
        *,
        slopes: list[float] | None = None,
        sinks: int = 0,
        rounding: KeyRounding | None = None,
    ):
        super().__init__()
        if kind not in BIAS_KINDS:
            raise ValueError(f"Unknown ALiBi bias kind {kind!r}; expected one of {BIAS_KINDS}.")
        if slopes is not None and len(slopes) != num_heads:
            raise ValueError(f"ALiBi needs one slope per head: {num_heads}, got {len(slopes)}.")
        self.num_heads = num_heads
        values = tuple(get_slopes_list(num_heads) if slopes is None else (float(s) for s in slopes))
        # what this layer adds, one value (slopes.BiasSpec); kind, slope_values, sinks and rounding read and set it
        self.spec = BiasSpec(kind, values, sinks, rounding)  # rounding: the bias rounded per key (Falcon's code)
        self.path = path
        self.last_path: str | None = None
        self.window = None  # the rotary window (window.py), set by the conversion
        self.shared = SharedByLayers() if shared is None else shared
        if kind == LEARNED:
            self.slopes_left = nn.Parameter(torch.empty(num_heads))
            self.slopes_right = nn.Parameter(torch.empty(num_heads))
            self.reset_parameters()
        self._slopes_by_device: dict[torch.device, torch.Tensor] = {}
        self._terms_by_device: dict[torch.device, torch.Tensor] = {}  # rounding: t(p) over positions 0..n-1

    def reset_parameters(self) -> None:
        """The seed's initialisation of the learned slopes: normal(-2, 1) before the -sigmoid."""
        if self.kind == LEARNED:
            with torch.no_grad():
                self.slopes_left.normal_(-2.0, 1.0)
                self.slopes_right.normal_(-2.0, 1.0)

    def fixed_slopes(self, device: torch.device) -> torch.Tensor:
        """The fixed forms' slopes (the paper's unless set), float32 ``(H,)``, made once per device (per
        call while traced: a graph holds them as a constant, and a dict filled during tracing would fail
        its guard and recompile)."""
        if is_exporting():
            return torch.tensor(self.slope_values, dtype=torch.float32, device=device)
        slopes = self._slopes_by_device.get(device)
        if slopes is None:
            slopes = torch.tensor(self.slope_values, dtype=torch.float32, device=device)
            self._slopes_by_device[device] = slopes
        return slopes

    def forward(
        self,
        q_len: int,
        kv_len: int,
        device: torch.device,
        masked_value: float,
        *,
        starts: torch.Tensor | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """The bias with this layer's own masking (causal, nonsymmetric), fp32 ``(1, H, q, kv)`` (``(B, H, q, kv)``
        with sinks on left-padded rows). ``starts`` and ``end`` place sinks and a rounded bias: the forward's
        (:class:`forward.AlibiForward`), where each row's real tokens start and where the sequence ends."""
        spec = self.spec
        if spec.kind == CAUSAL and q_len == 1 and spec.plain and not is_exporting():  # a decoding step
            return decoding_row(self, kv_len, device)  # a view of a kept row, not built per step
        if self.rounding is not None:
            unpadded = starts is None or (starts.dim() == 1 and not bool(starts.any()))
            if q_len == 1 and not is_exporting() and unpadded:
                return self._rounded_decoding_row(kv_len, end, device)  # a view of a kept table, less a column
            slopes = self.fixed_slopes(device)
            return alibi_bias(CAUSAL, q_len, kv_len, slopes, masked_value=masked_value, starts=starts, end=end,
                              rounding=self.rounding)  # fmt: skip
        sinks = dict(sinks=self.sinks, starts=starts, end=end)
        if self.kind == LEARNED:
            left, right = self.learned_slopes()
            return alibi_bias(LEARNED, q_len, kv_len, left, slopes_right=right, masked_value=masked_value, **sinks)
        return alibi_bias(self.kind, q_len, kv_len, self.fixed_slopes(device), masked_value=masked_value, **sinks)

    def _rounded_decoding_row(self, kv_len: int, end: int | None, device: torch.device) -> torch.Tensor:
        """A decoding step's bias rounded per key, no padding: ``t(p_j) - t(p_q)``, fp32 ``(1, H, 1, kv_len)``, from
        a table of ``t`` over positions kept per device (grown by doubling), not built per step."""
        query, key_offset = offsets(1, kv_len, end)
        size = max(query + 1, key_offset + kv_len)
        table = self._terms_by_device.get(device)
        if table is None or table.shape[1] < size:
            length = max(256, 1 << (size - 1).bit_length())
            positions = torch.arange(length, device=device, dtype=torch.float32)
            table = self._terms_by_device[device] = self.rounding.terms(self.fixed_slopes(device), positions)
        return (table[:, key_offset : key_offset + kv_len] - table[:, query : query + 1])[None, :, None, :]

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def slope_values(self) -> tuple[float, ...]:
        return self.spec.slopes

    @property
    def sinks(self) -> int:
        return self.spec.sinks

    @sinks.setter
    def sinks(self, value: int) -> None:
        self.spec = replace(self.spec, sinks=value)
        self._set_sharing()

    @property
    def rounding(self) -> KeyRounding | None:
        return self.spec.rounding

    @rounding.setter
    def rounding(self, value: KeyRounding | None) -> None:
        self.spec = replace(self.spec, rounding=value)
        self._set_sharing()

    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, value: str) -> None:
        if value not in PATHS:
            raise ValueError(f"ALiBi path must be one of {PATHS}, got {value!r}.")
        self._path = value
        self._set_sharing()

    def _set_sharing(self) -> None:
        # what layers that may share a merged mask have in common (mask.shared_mask): the bias (one value, its spec)
        # and the path setting; the learned form shares none (its slopes are its own parameters)
        self.sharing = None if self.spec.kind == LEARNED else (self.spec, self._path)

    def learned_slopes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned form's (left, right) slopes, fp32 and negative, with their gradients."""
        return -torch.sigmoid(self.slopes_left.float()), -torch.sigmoid(self.slopes_right.float())

    def check_heads(self, query: torch.Tensor) -> None:
        if query.shape[1] != self.num_heads:
            raise ValueError(f"ALiBi was set up for {self.num_heads} heads but this layer computes {query.shape[1]}.")

    def extra_repr(self) -> str:
        extra = f", sinks={self.sinks}" if self.sinks else ""
        extra += f", rounding={self.rounding}" if self.rounding is not None else ""
        return f"kind={self.kind!r}, num_heads={self.num_heads}, path={self.path!r}{extra}"


def set_attention_path(model: nn.Module, path: str) -> nn.Module:
    """Set how every ALiBi layer of ``model`` applies its bias on the sdpa backend.

    ``"auto"`` (default) folds causal attention into SDPA's causal kernel where that is exact
    and takes the bias tensor elsewhere; ``"folded"`` forces the fold (an error where it would be
    wrong); ``"bias"`` always builds the bias tensor. ``HF_ALIBI_PATH`` sets the same for layers
    left at ``"auto"``.

    >>> hf_alibi.set_attention_path(model, "bias")  # doctest: +SKIP
    """
    if path not in PATHS:
        raise ValueError(f"ALiBi path must be one of {PATHS}, got {path!r}.")
    layers = [m for m in model.modules() if isinstance(m, AlibiBias)]
    if not layers:
        raise ValueError("This model has no ALiBi layers: convert it with hf_alibi.patch_model first.")
    for layer in layers:
        layer.path = path
    return model
