"""The few ways a position path is removed: an absolute table, a rotary embedding, T5's relative bias.

Each strategy is ``strategy(base_model, paths)``: ``paths`` are the row's ``position`` entries,
resolved from the base model by :func:`find_modules`. A strategy must not depend on weight values: it
also runs on freshly built models (``from_pretrained`` loads the weights afterwards). The parts a
pretrained model keeps (:class:`RetainedRotary`, :class:`RetainedTable`) are the exception, each in its
way: the rotary frequencies come from the config, the kept table is a buffer the weights carry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .compat import is_exporting
from .partitions import partitioning, whole_shape


def find_modules(root: nn.Module, path: str) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute name, module)`` for every module at ``path`` under ``root``.

    ``path`` is dotted; ``*`` stands for every child (every layer of a ``ModuleList``); a trailing
    ``?`` means the path may be missing (T5's encoder-only model has no decoder). A required path that
    matches nothing raises, so a row that no longer fits transformers' layout is never a silent no-op.

    >>> find_modules(model.base_model, "h.*.attn")  # doctest: +SKIP
    """
    optional = path.endswith("?")
    parts = path.removesuffix("?").split(".")
    found: list[tuple[nn.Module, str, nn.Module]] = [(None, "", root)]
    for part in parts:
        step = []
        for _, _, module in found:
            if part == "*":
                step += [(module, name, child) for name, child in module.named_children()]
            elif isinstance(getattr(module, part, None), nn.Module):
                step.append((module, part, getattr(module, part)))
        found = step
    if not found and not optional:
        raise ValueError(
            f"{type(root).__name__} has no module at {path!r}: the hf_alibi architecture row does not fit "
            "this model (a transformers version with another layout?)."
        )
    return found


class NoPositionEmbedding(nn.Module):
    """Stands where a learned absolute position table was: adds nothing, whatever the positions.

    It has no weights and no size, so inputs of any length run, and it returns a 0-dim zero so
    that ``embeds + self.wpe(position_ids)`` keeps the embeddings' dtype and shape. It accepts any
    arguments (OPT's table takes the attention mask, the cache length and ``position_ids=``).
    """

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        return torch.zeros((), device=tensors[0].device if tensors else None)


class IdentityRotary(nn.Module):
    """Stands where a rotary embedding was: answers ``cos = 1, sin = 0`` at the original width.

    Llama-style code rotates with ``q * cos + rotate_half(q) * sin`` over the width ``cos`` has, and
    partial-rotary code (Phi-3, StableLM, GPT-NeoX) rotates the first ``cos.shape[-1]`` dimensions:
    with ones and zeros of the width the original module returns, every variant leaves q and k
    exactly as they were. The width is asked of the original module once per call signature (one
    position), so nothing here is sized by ``max_position_embeddings``; the answer is a broadcast
    view, no (B, L, width) tensor is filled. The original is kept as ``original`` (its buffers are
    not persistent: the state dict does not change).
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.original = original
        self._probes: dict = {}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        key, probe = None, None
        # Traced (torch.compile / export): asked every time, since a dict filled during tracing fails
        # its guard and recompiles; the graph keeps only the width (a constant) and drops the probe.
        if not is_exporting():
            try:
                key = (x.dtype, x.device, args, tuple(sorted(kwargs.items())))
                probe = self._probes.get(key)
            except TypeError:  # an unhashable extra argument: ask every time
                key = None
        if probe is None:
            with torch.no_grad():
                cos, sin = self.original(x, position_ids[..., :1], *args, **kwargs)
            probe = (cos.new_ones(()), sin.new_zeros(()), cos.shape[-1])
            if key is not None:
                self._probes[key] = probe
        one, zero, width = probe
        shape = (*position_ids.shape, width)  # (B, L, width)
        return one.expand(shape), zero.expand(shape)


class RetainedRotary(nn.Module):
    """Stands where a rotary embedding was: keeps its short-wavelength frequencies, removes the rest.

    A rotary dimension of frequency ``w`` (radians per token) has wavelength ``2 pi / w``. Those of
    wavelength ``<= max_wavelength`` keep the original's ``cos`` and ``sin``; the others answer the
    original's value at position 0 (``cos = 1``, ``sin = 0``; times the rope type's attention scaling
    where it has one), i.e. no rotation. Without a knee, rotary is relative, so which absolute positions the model
    passes (hf_alibi drops ``position_ids``; the model counts from its cache) changes nothing.

    Which dimensions are kept is read from the original's own answer at positions 0 and 1 (the
    angle ``atan2(sin, cos)`` at position 1 is ``w``, in float32), once per call signature: so it
    holds for every layout (halves as Llama, interleaved pairs as Cohere, partial rotary as Phi-3 or
    GPT-NeoX) and depends on the config (``inv_freq`` is a non-persistent buffer), not on weights. A
    ``dynamic`` rope type keeps the frequencies it was trained at (no per-length rescaling). ``kept``
    reports the last probe's mask (tests), ``frequency`` its channels' frequencies (the rotary window reads
    them). The original is kept as ``original``.

    With a ``knee`` (``rotary_knee``, the original length in the preset) and ``stretch > 1``, the kept dimensions of
    wavelength longer than the knee, which never completed a turn in training, read position ``K + (p - K) /
    stretch`` past ``K = knee - 1``: inside the knee every angle is the original's, past it those dimensions turn
    ``stretch`` times slower, so they stay near the angles training saw. That is a function of the absolute
    position, which every path hands this module: the cache's count in generation (a left-padded row counts its
    padding: its knee comes that many tokens early), a packed row's per-document ids, continuous batching's and
    vLLM's per-request positions.

    With ``interpolation > 1`` (``rotary_interpolation``) those dimensions read ``p / interpolation`` at every position
    (after the knee's map where there is one): their relative angles are interpolated, as YaRN's slowest part.
    """

    def __init__(
        self,
        original: nn.Module,
        max_wavelength: float,
        knee: float | None = None,
        stretch: float = 1.0,
        interpolation: float = 1.0,
    ):
        super().__init__()
        if "dynamic" in str(getattr(original, "rope_type", "")):
            # Dynamic NTK scaling stretches RoPE past its trained length (ALiBi does that now) and reads the
            # config's max_position_embeddings, which a converted model no longer has: keep the frequencies it
            # was built with (those it was trained at) and stop the per-length update.
            original.rope_type = "default"
        self.original = original
        self.max_wavelength = float(max_wavelength)
        # the kept frequencies of wavelength > ``knee`` turn ``stretch`` times slower past it and ``interpolation``
        # times slower everywhere (None: as trained)
        self.knee = None if knee is None or (stretch == 1 and interpolation == 1) else float(knee)
        self.stretch, self.interpolation = float(stretch), float(interpolation)
        self._probes: dict = {}
        self.kept: torch.Tensor | None = None
        self.frequency: torch.Tensor | None = None  # each channel's radians per token, from the last probe

    def _probe(self, x: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            key = (x.dtype, x.device, args, tuple(sorted(kwargs.items())))
            probe = self._probes.get(key)
        except TypeError:  # an unhashable extra argument: ask every time
            key, probe = None, None
        if probe is None:
            with torch.no_grad():
                positions = torch.arange(2, device=x.device)[None]  # (1, 2): positions 0 and 1
                cos, sin = self.original(x.float(), positions, *args, **kwargs)
            cos, sin = cos.float().reshape(-1, 2, cos.shape[-1])[0], sin.float().reshape(-1, 2, sin.shape[-1])[0]
            frequency = torch.atan2(sin[1], cos[1])  # (width,), radians per token
            kept = frequency.abs() >= 2 * math.pi / self.max_wavelength  # wavelength <= the bound
            slowed = kept & (frequency.abs() < 2 * math.pi / self.knee) if self.knee else None  # wavelength > knee
            probe = (kept, cos[0].to(x.dtype), sin[0].to(x.dtype), slowed, frequency)  # removed: position 0's value
            if key is not None:
                self._probes[key] = probe
        self.kept, self.frequency = probe[0], probe[4]
        return probe[:4]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        kept, cos0, sin0, slowed = self._probe(x, args, kwargs)
        cos, sin = self.original(x, position_ids, *args, **kwargs)  # (B, L, width)
        if slowed is not None:
            # a position p past the knee K (the last trained position, knee - 1) reads K + (p - K) / stretch for
            # the slowed dimensions: the same angles inside, angles close to training's past it (every path that
            # gives this module positions, the cache's count, a packed row's or a batch's own, gets the same)
            last = self.knee - 1
            stretched = position_ids
            if self.stretch != 1:
                stretched = torch.where(position_ids > last, last + (position_ids - last) / self.stretch, position_ids)
            if self.interpolation != 1:  # every position: relative angles interpolated, as YaRN's slowest part
                stretched = stretched / self.interpolation
            cos_s, sin_s = self.original(x, stretched.float(), *args, **kwargs)
            cos, sin = torch.where(slowed, cos_s, cos), torch.where(slowed, sin_s, sin)
        return torch.where(kept, cos, cos0.to(cos.dtype)), torch.where(kept, sin, sin0.to(sin.dtype))

    def extra_repr(self) -> str:
        knee = "" if self.knee is None else f", knee={self.knee}, stretch={self.stretch}"
        knee += "" if self.knee is None or self.interpolation == 1 else f", interpolation={self.interpolation}"
        return f"max_wavelength={self.max_wavelength}{knee}"


class RetainedTable(nn.Module):
    """Stands where a learned absolute position table was: keeps its short-wavelength periodic part, repeated.

    A table's ``rows`` used rows (from its first position: RoBERTa's ``padding_idx + 1``) are a sum of Fourier
    components: component ``k`` turns ``k`` times over the rows (wavelength ``rows / k`` tokens). Those of
    wavelength ``<= max_wavelength`` are kept (``k >= 1``: the mean is ``position_mean``'s), the others removed,
    and since every kept component turns a whole number of times over the rows, position ``p`` reads row
    ``(p - first) mod rows``: the same sinusoids continued past the table, so any length runs. Positions before
    ``first`` (RoBERTa's padding) get zeros. The kept part is the buffer ``table``, saved with the weights: it
    is computed from ``source`` (the table being replaced) at conversion, and a model rebuilt from a checkpoint
    (``source=None``, zeros) gets it from the loaded weights.
    """

    def __init__(
        self, rows: int, width: int, max_wavelength: float, first: int = 0, source: torch.Tensor | None = None
    ):
        super().__init__()
        self.rows, self.first, self.max_wavelength = int(rows), int(first), float(max_wavelength)
        table = torch.zeros(self.rows, width)
        if source is not None and partitioning(source) is None:  # else rebuilt: the buffer loads with the weights
            table = periodic_part(source.detach()[self.first : self.first + self.rows].float(), self.max_wavelength)
        self.register_buffer("table", table)

    def forward(self, position_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        index = position_ids.long() - self.first
        rows = self.table[index.remainder(self.rows)]  # (..., width)
        return rows.masked_fill((index < 0)[..., None], 0.0)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, max_wavelength={self.max_wavelength}, first={self.first}"


def periodic_part(table: torch.Tensor, max_wavelength: float) -> torch.Tensor:
    """The Fourier components of ``table`` (``(rows, width)``, along the rows) of wavelength ``rows / k <=
    max_wavelength`` tokens, ``k >= 1`` (the mean removed), summed back to ``(rows, width)`` in float32."""
    rows = table.shape[0]
    spectrum = torch.fft.rfft(table.double(), dim=0)  # (rows // 2 + 1, width)
    k = torch.arange(spectrum.shape[0], dtype=torch.float64, device=table.device)
    kept = (k >= 1) & (k * max_wavelength >= rows)  # rows / k <= max_wavelength
    return torch.fft.irfft(spectrum * kept[:, None], n=rows, dim=0).float()


def table_rows(table: nn.Module) -> tuple[int, int]:
    """``(first, rows)``: where a learned table's used rows begin (OPT's offset, RoBERTa's ``padding_idx + 1``)
    and how many there are."""
    padding = getattr(table, "padding_idx", None)
    first = getattr(table, "offset", None) or (padding + 1 if padding is not None else 0)
    return first, whole_shape(table.weight)[0] - first


def retained_table(base: nn.Module, paths: tuple[str, ...], max_wavelength: float, rows: int) -> None:
    """A learned table added to the token embeddings (BERT's, RoBERTa's): its short-wavelength periodic part
    instead (:class:`RetainedTable`), ``rows`` rows long. Where the table's owner takes its default positions
    from a buffer sized by the maximum length (BERT), they are made per input instead, so any length runs."""
    for path in paths:
        for parent, name, table in find_modules(base, path):
            if isinstance(table, RetainedTable):
                continue
            first, own_rows = table_rows(table)
            rows = rows or own_rows  # settings made by hand may leave the count to the table
            source = table.weight if own_rows == rows else None  # a model being rebuilt: the weights load later
            width = whole_shape(table.weight)[1]
            setattr(parent, name, RetainedTable(rows, width, max_wavelength, first, source))
            _unbounded_defaults(parent, positions=True)


def absolute(base: nn.Module, paths: tuple[str, ...], settings=None) -> None:
    """A learned table added to the token embeddings (GPT-2's ``wpe``, BERT's, OPT's): a zero instead, or with
    ``settings.table_max_wavelength`` its short-wavelength periodic part (:func:`retained_table`).

    Where the table's owner also makes default token types from a buffer sized by the maximum length
    (BERT, RoBERTa), they are made per input instead, so any length runs without ``token_type_ids``.
    """
    if getattr(settings, "table_max_wavelength", None) is not None:  # validated: an encoder's table
        retained_table(base, paths, settings.table_max_wavelength, settings.table_rows)
        return
    for path in paths:
        for parent, name, _ in find_modules(base, path):
            setattr(parent, name, NoPositionEmbedding())
            _unbounded_defaults(parent)


# Where a learned table's owner adds other per-token vectors that can take the table's mean: token types
# first (added to every token, used for nothing else), else the token embeddings.
_FOLD_TARGETS = ("token_type_embeddings", "wte", "word_embeddings", "embed_tokens")


MeanEdits = tuple[tuple[nn.Embedding, torch.Tensor], ...]  # (embedding, fp32 vector to add) pairs


def position_mean_edits(base: nn.Module, paths: tuple[str, ...], rows: int) -> MeanEdits:
    """What ``position_mean`` adds, measured before :func:`absolute` removes the tables (nothing changed here): for
    each table, the mean of its first ``rows`` used rows (from its first position: OPT's offset, RoBERTa's
    ``padding_idx + 1``), fp32, and the embedding it goes to, the vectors its owner adds to every token (token-type
    embeddings, else the token embeddings), so every token keeps the table's average offset (added by
    :func:`add_position_means`). A tied LM head then gets the same vector in every row: the logits move by the same
    amount for every token, so probabilities, losses and generation are unchanged by it. ``ValueError`` where the
    owner transforms its token embeddings before adding the table (OPT's ``project_in``).
    """
    edits = []
    for path in paths:
        for parent, _, table in find_modules(base, path):
            target = next(
                (getattr(parent, n) for n in _FOLD_TARGETS if isinstance(getattr(parent, n, None), nn.Embedding)), None
            )
            if target is None or getattr(parent, "project_in", None) is not None:
                raise ValueError(
                    f"position_mean cannot fold {path!r} of {type(base).__name__}: its owner has no token-type or "
                    "token embedding added with it unchanged (a projection in between?). Pass position_mean=0."
                )
            first, _ = table_rows(table)
            used = table.weight[first : first + rows]
            if used.shape[0] == 0:
                raise ValueError(f"position_mean: {path!r} has no rows from position {first}. Pass position_mean=0.")
            edits.append((target, used.detach().float().mean(0)))
    return tuple(edits)


def add_position_means(edits: MeanEdits) -> None:
    """Add what :func:`position_mean_edits` measured, in the embeddings' dtype."""
    with torch.no_grad():
        for target, mean in edits:
            target.weight.add_(mean.to(target.weight.dtype))


def rotary(base: nn.Module, paths: tuple[str, ...], settings=None) -> None:
    """A rotary embedding made once per forward (``base.rotary_emb``): the identity rotation instead, or with
    ``settings.rotary_max_wavelength`` only the frequencies of longer wavelength removed (:class:`RetainedRotary`)."""
    max_wavelength = getattr(settings, "rotary_max_wavelength", None)
    knee, stretch = getattr(settings, "rotary_knee", None), getattr(settings, "rotary_stretch", 1.0)
    interpolation = getattr(settings, "rotary_interpolation", 1.0)
    for path in paths:
        for parent, name, module in find_modules(base, path):
            if isinstance(module, (IdentityRotary, RetainedRotary)):
                continue
            setattr(
                parent,
                name,
                IdentityRotary(module)
                if max_wavelength is None
                else RetainedRotary(module, max_wavelength, knee, stretch, interpolation),
            )


def relative(base: nn.Module, paths: tuple[str, ...], settings=None) -> None:
    """T5's learned relative bias, computed by the attention modules at ``paths`` (each stack's first
    block): the table goes. T5's code then makes its ``position_bias`` zeros, and hf_alibi's attention
    drops it in self-attention layers, so ALiBi is the only position signal."""
    for path in paths:
        for _, _, attention in find_modules(base, path):
            if getattr(attention, "has_relative_attention_bias", False):
                del attention.relative_attention_bias
                attention.has_relative_attention_bias = False


def _unbounded_defaults(owner: nn.Module, positions: bool = False) -> None:
    """Where a table's owner (BERT's, RoBERTa's embeddings) makes default inputs from buffers sized by the maximum
    length, they are made per input instead: token types always, and with ``positions`` the position ids (unless
    the owner counts them from the input ids itself, as RoBERTa does)."""
    if isinstance(getattr(owner, "token_type_ids", None), torch.Tensor):
        owner.register_forward_pre_hook(_default_token_types, with_kwargs=True)
    if positions and isinstance(getattr(owner, "position_ids", None), torch.Tensor):
        if not hasattr(owner, "create_position_ids_from_input_ids"):
            owner.register_forward_pre_hook(_default_positions, with_kwargs=True)


def _input_shape(kwargs: dict) -> tuple[torch.Size, torch.device]:
    """``(batch, length)`` and the device of the input an embeddings module is called with (ids or embeds)."""
    input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    return (input_ids.shape, input_ids.device) if input_ids is not None else (embeds.shape[:-1], embeds.device)


def _default_token_types(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # The original default gathers from a buffer of length max_position_embeddings; all zeros, of
    # the input's shape, is the same value without the length limit.
    if kwargs.get("token_type_ids") is None:
        shape, device = _input_shape(kwargs)
        kwargs["token_type_ids"] = torch.zeros(shape, dtype=torch.long, device=device)
    return args, kwargs


def _default_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # The original default slices a buffer of length max_position_embeddings: the same count from the
    # cache's length, without the limit.
    if kwargs.get("position_ids") is None:
        shape, device = _input_shape(kwargs)
        start = kwargs.get("past_key_values_length", 0) or 0
        kwargs["position_ids"] = torch.arange(start, start + shape[1], device=device)[None]
    return args, kwargs


# name -> strategy(base model, the row's position paths, the AlibiSettings); a row names one.
# hf_alibi.register_architecture(row, strategy=...) adds custom ones (not saved with checkpoints).
# what reads position ids after a conversion (the model's own count, from its cache, unless hf_alibi keeps the ids)
POSITION_READERS = (RetainedTable, RetainedRotary)

STRATEGIES: dict[str, Callable[[nn.Module, tuple[str, ...], Any], None]] = {
    "absolute": absolute,
    "rotary": rotary,
    "relative": relative,
}
# The strategies a checkpoint's remote code has: custom ones need the code that registered them.
BUILTIN_STRATEGIES = frozenset(STRATEGIES)
