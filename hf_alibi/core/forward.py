"""One forward of a converted model as its ALiBi layers see it (:class:`AlibiForward`), handed to them in the open.

Before every forward, the model's own class (``conversion.alibi_model_class``, ``native``'s) or, for a direct call
of its base model, a pre-hook, reads the forward's arguments once (:func:`before_forward`): the position ids (a
packed row's documents), the padding mask and cache (where each row's tokens start and the sequence ends: what sinks
and Falcon's rounded bias are placed by) and a continuous-batching step's paged layout. It makes one
:class:`AlibiForward` of them and passes it down as the keyword argument ``alibi_forward``: transformers hands a
model's keyword arguments to every attention function (``**kwargs``), so each layer reads it there
(:func:`forward_of`), and the merged masks its layers share live in it, for this forward only.

Some callers drop keyword arguments on the way down: StableLM's and Nemotron's decoder layers call ``self_attn``
without theirs, BLOOM's, MPT's and Falcon's blocks take fixed ones (``native``). Their layers read the same value
from the context of the forward that made it (a ``contextvars.ContextVar``: per thread and asyncio task, put back
when that forward ends), and while torch.compile or torch.export traces (dynamo cannot set a ContextVar) from
:attr:`SharedByLayers.traced`, which the traced forward sets and clears itself.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .batching import PagedBatch, paged_batch
from .compat import GradientCheckpointingOverride, cache_argument, is_exporting
from .mask import attends
from .names import granted_engine
from .packing import document_starts, is_packed

KEYWORD = "alibi_forward"  # the keyword argument an AlibiForward travels under


@dataclass(eq=False, slots=True, weakref_slot=True)  # slots: made before every forward, read by every layer
class AlibiForward:
    """What one forward tells every ALiBi layer, and what its layers share.

    ``documents``: each token's document start in a packed row ``(B|1, L)`` (:func:`packing.document_starts`), else
    ``None``. ``starts``: where each row's real tokens start ``(B,)`` (``None``: at 0), and ``end``: the sequence's
    end position (``None``: the layer's key count), read only where the bias needs them (sinks, a bias rounded per
    key); a packed row's ``starts`` are its ``documents``. ``paged``: a continuous-batching step's layout
    (:class:`batching.PagedBatch`), else ``None``. ``masks``: the merged masks this forward's layers made, keyed by
    what they depend on (``mask.py``), never filled while traced. ``builds`` counts them (tests read it).
    A layer called on its own (no model forward around it) gets an empty one: nothing recorded, nothing shared.
    """

    documents: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    end: int | None = None
    paged: PagedBatch | None = None
    masks: dict = field(default_factory=dict, repr=False)
    builds: int = 0
    outer: object = field(default=None, repr=False)  # the forward running around this one (nested forwards)
    entered_by: object = field(default=None, repr=False)  # the module whose forward put it in the context
    shared: object = field(default=None, repr=False)  # that model's SharedByLayers
    attentions: bool = False  # the caller asked for attention weights (hf_alibi.native runs such a forward on eager)

    MAX_MASKS = 4  # transformers makes one mask per layer kind (full, sliding, chunked)

    def rows(self, alibi) -> tuple[torch.Tensor | None, int | None]:
        """``(starts, end)`` for ``alibi``'s layer: this forward's where its bias is placed by them (sinks, a bias
        rounded per key), else ``(None, None)`` (a plain bias never reads them)."""
        return (self.starts, self.end) if alibi.sinks or alibi.rounding is not None else (None, None)

    def cached(self, key: tuple, attention_mask, build, *args) -> torch.Tensor:
        """The mask this forward made for ``key`` and transformers' mask object, else ``build(*args)``, kept."""
        entry_key = (key, id(attention_mask))
        hit = self.masks.get(entry_key)
        if hit is not None:
            return hit[1]
        merged = build(*args)
        self.builds += 1
        if len(self.masks) >= self.MAX_MASKS:
            del self.masks[next(iter(self.masks))]  # the oldest
        # the entry holds the mask it was made from, so its id cannot be reused while the entry lives
        self.masks[entry_key] = (attention_mask, merged)
        return merged


class SharedByLayers:
    """What the ALiBi layers of one model share beyond one forward: each decoding row, kept per the slopes and device
    it depends on (``mask.decoding_row``), and, while the model's forward is traced, that forward's
    :class:`AlibiForward` for layers whose caller drops keyword arguments. Copies (deepcopy, pickling) start empty."""

    def __init__(self):
        self.decoding_rows: dict[tuple, torch.Tensor] = {}  # (slopes, device) -> fp32 (1, H, 1, n), replaced whole
        self.traced: AlibiForward | None = None

    def __deepcopy__(self, memo) -> SharedByLayers:
        return SharedByLayers()  # deepcopy's memo keeps one new object per copied model

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


_RUNNING: ContextVar[AlibiForward | None] = ContextVar("hf_alibi_forward", default=None)


def forward_of(alibi, kwargs: dict) -> AlibiForward | None:
    """The forward this attention call of ``alibi``'s layer belongs to, taken out of ``kwargs`` (the kernels never
    see it): passed down by the model, else the one running around this call (its caller dropped keyword
    arguments), else an empty one. ``None`` for a layer without ALiBi (``alibi`` None: cross-attention)."""
    forward = kwargs.pop(KEYWORD, None)
    if forward is None and alibi is not None:
        forward = alibi.shared.traced if is_exporting() else _RUNNING.get()
        if forward is None:
            forward = AlibiForward()
    return forward


def enter(forward: AlibiForward, shared: SharedByLayers, module: nn.Module) -> None:
    """``forward`` is the one running in ``module``'s forward (for layers whose caller drops keyword arguments)."""
    if is_exporting():
        shared.traced = forward
        return
    forward.outer, forward.entered_by, forward.shared = _RUNNING.get(), module, shared
    _RUNNING.set(forward)


def leave(forward: AlibiForward | None, shared: SharedByLayers, module: nn.Module) -> None:
    """``module``'s forward has ended (also by raising): the forward it entered is no longer running."""
    if is_exporting():
        shared.traced = None
    elif forward is not None and forward.entered_by is module and _RUNNING.get() is forward:
        _RUNNING.set(forward.outer)
        forward.outer = None


@dataclass(frozen=True)
class ForwardSetup:
    """What a converted model's forward reads before it runs: what its layers share (``shared``), whether anything in
    the model reads position ids (a retained table or rotary, ``strategies.POSITION_READERS``), its sinks, and whether
    its bias needs each row's start without sinks (a bias rounded per key, ``slopes.KeyRounding``)."""

    shared: SharedByLayers
    reads_positions: bool
    sinks: int
    records_rows: bool = False


def before_forward(
    setup: ForwardSetup, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict, AlibiForward | None]:
    """Before a forward of a converted model (or its base): this forward's :class:`AlibiForward`, made from its
    arguments and added to them (``alibi_forward``), with the arguments as the model then takes them (position ids
    dropped, :func:`_read_position_ids`). ``None`` when the arguments already carry one (a task head's forward
    made it and calls its base), or when the config lets another engine run the model (``names.grant_engine``: its
    attention function places the bias and each request's tokens, and the position ids reach the model as given)."""
    if kwargs.get(KEYWORD) is not None:
        return args, kwargs, None
    if granted_engine(module.config) is not None:  # another engine's kernels place the bias (vLLM's)
        return args, kwargs, None
    args, kwargs, documents, paged = _read_position_ids(setup.reads_positions, module, args, kwargs)
    starts = end = None
    if paged is None and (setup.sinks or setup.records_rows):  # paged: sinks follow each request (batching.py)
        starts, end = (documents, None) if documents is not None else _row_ends(module, args, kwargs, setup.sinks)
    forward = AlibiForward(documents, starts, end, paged)
    kwargs[KEYWORD] = forward
    return args, kwargs, forward


def call_forward(setup: ForwardSetup, module: nn.Module, call, args: tuple, kwargs: dict, prepare=None):
    """``call(*args, **kwargs)``, the original class's forward of a converted (or native) model, with this forward's
    :class:`AlibiForward` made (:func:`before_forward`), passed down and running around it, also when it raises.
    ``prepare(forward, args, kwargs) -> (args, kwargs)``: a last change of the arguments (``hf_alibi.native``'s)."""
    args, kwargs, forward = before_forward(setup, module, args, kwargs)
    if prepare is not None:
        args, kwargs = prepare(forward, args, kwargs)
    if forward is None:  # another forward around this one made it
        return call(*args, **kwargs)
    enter(forward, setup.shared, module)  # for layers whose caller drops keyword arguments
    try:
        return call(*args, **kwargs)
    finally:
        leave(forward, setup.shared, module)


def reentering(checkpoint_function):
    """transformers' gradient-checkpointing function, made to run each checkpointed layer inside the forward it was
    called in: the backward pass recomputes the layer after that forward has ended, and a layer whose caller drops
    keyword arguments reads the forward from the running one (the others find it again in the saved arguments).
    Without it the recomputed layer would see no rows, documents or sinks, and the gradients would be another model's
    (measured: StableLM with sinks and left padding, 0.045 off)."""
    if getattr(checkpoint_function, "reenters_alibi_forward", False):
        return checkpoint_function

    def checkpoint(function, *args, **kwargs):
        running = None if is_exporting() else _RUNNING.get()
        if running is None:
            return checkpoint_function(function, *args, **kwargs)

        def in_forward(*inner_args, **inner_kwargs):  # in the forward, and again when the backward recomputes it
            token = _RUNNING.set(running)
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                _RUNNING.reset(token)

        return checkpoint_function(in_forward, *args, **kwargs)

    checkpoint.reenters_alibi_forward = True
    return checkpoint


class CheckpointsInForward(GradientCheckpointingOverride):
    """Mixin of the converted and native model classes: transformers' gradient checkpointing (``Trainer``'s
    ``gradient_checkpointing=True``, ``model.gradient_checkpointing_enable()``) runs each checkpointed layer inside its
    forward (:func:`reentering`)."""

    checkpoint_function = staticmethod(reentering)


def hook_base(base: nn.Module, setup: ForwardSetup, first: bool = False) -> None:
    """A base model that is not the model itself (a task head's) makes its forward's :class:`AlibiForward` in hooks
    when called directly (a task head may call its inner stack past the base: the class's forward covers that).
    ``first``: before the hooks already there."""
    base.register_forward_pre_hook(partial(forward_pre_hook, setup), with_kwargs=True, prepend=first)
    base.register_forward_hook(partial(forward_hook, setup), with_kwargs=True, always_call=True)


def forward_pre_hook(setup: ForwardSetup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """:func:`before_forward` as a base model's forward pre-hook (a direct call of the base, past its task head).
    Called by its task head's forward, the base takes the head's forward on (a head may not pass it down, nor the
    position ids it was made from: BLOOM's)"""
    running = setup.shared.traced if is_exporting() else _RUNNING.get()
    if running is not None and kwargs.get(KEYWORD) is None and (is_exporting() or running.shared is setup.shared):
        kwargs[KEYWORD] = running
        return args, kwargs
    args, kwargs, forward = before_forward(setup, module, args, kwargs)
    if forward is not None:
        enter(forward, setup.shared, module)
    return args, kwargs


def forward_hook(setup: ForwardSetup, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    """The end of a base model's forward (also one that raised): what :func:`forward_pre_hook` entered, left."""
    leave(kwargs.get(KEYWORD), setup.shared, module)


def _all_layers_slide(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "full_attention" not in layer_types
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def _row_ends(module: nn.Module, args: tuple, kwargs: dict, sinks: int) -> tuple[torch.Tensor | None, int | None]:
    # Sinks are the first real tokens of each row: where the 2D padding mask's ones start (left padding), and the
    # sequence's end (the mask's length: past + new tokens), which places the keys of static caches (more slots than
    # tokens) and sliding caches (fewer).
    values = kwargs if "attention_mask" in kwargs else bound_arguments(module, args, kwargs)
    mask = values.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.to(torch.long).argmax(dim=-1), mask.shape[-1]  # argmax: the first 1 of each row
    starts = end = None
    if isinstance(mask, dict):  # one 4D mask per layer type (generate() with a static cache, mixed layers)
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4 and _all_layers_slide(module.config):
        raise ValueError(
            f"sinks={sinks} with a 4D attention mask on a sliding-window model: the mask cannot "
            "tell padding from keys outside the window. Pass the 2D attention_mask (generate() with the default "
            "dynamic cache does), or convert with sinks=0."
        )
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # (B, 1, q, kv), e.g. generate() with a static cache
        # a row's first key that some query may see: padding is hidden from every query (and, on a full
        # attention layer's mask, nothing else is)
        starts = attends(mask).any(dim=1).any(dim=1).to(torch.long).argmax(dim=-1)
    tokens = values.get("input_ids")
    tokens = tokens if tokens is not None else values.get("inputs_embeds")
    cache = cache_argument(values)
    if tokens is not None and cache is not None and hasattr(cache, "get_seq_length"):
        end = int(cache.get_seq_length()) + tokens.shape[1]
    return starts, end


def _read_position_ids(
    reads_positions: bool, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict, torch.Tensor | None, PagedBatch | None]:
    # ALiBi has no position index, so position ids are dropped (the model counts positions from its cache, as
    # without ids), with three exceptions: ids that restart at the row's first id, with no attention mask and no
    # cache to continue, are a packed row (transformers' padding-free format). Its documents are returned for this
    # forward (every attention path keeps them apart, sinks follow them) and the ids are kept (a retained table or
    # rotary reads positions inside each document). A continuous-batching step (a paged cache) keeps them: they
    # place each token in its request (batching.py), and the model would otherwise ask the paged cache for a length
    # it does not have. And one token a row (a decoding step) keeps them where nothing in the model reads positions
    # (``reads_positions``: a retained table or rotary): they reach nothing then (transformers' packed-row
    # detection needs more than one token), and dropped, the model would count them again at every step.
    # This runs before every forward, decoding steps included: the arguments are bound once, without inspect.
    position_ids = kwargs.get("position_ids")
    tracing = is_exporting()
    if tracing and position_ids is None:
        return args, kwargs, None, None
    # the cache by name (how transformers passes it), else among the positional arguments
    cache = cache_argument(kwargs)
    if cache is None and args:
        cache = cache_argument(bound_arguments(module, args, kwargs))
    paged = None if tracing else paged_batch(cache, kwargs)
    starts = None
    if position_ids is not None and paged is None:
        if tracing or position_ids.shape[-1] > 1:  # one token a row (a decoding step) is never a packed row
            fresh = cache is None or (hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) == 0)
            if bound_arguments(module, args, kwargs).get("attention_mask") is None and fresh:
                starts = document_starts(position_ids)
                if not tracing and not is_packed(starts):
                    starts = None
            if starts is None:
                kwargs["position_ids"] = None
        elif reads_positions:
            kwargs["position_ids"] = None
    return args, kwargs, starts, paged


_POSITIONAL_NAMES: dict[type, tuple[str, ...]] = {}  # a forward's class -> its positional parameters' names


def bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``module``'s forward arguments by name, those passed by position included (named by the forward's signature,
    read once per class: binding with inspect on every forward cost more than a decoding step's attention)."""
    if not args:
        return kwargs
    names = _POSITIONAL_NAMES.get(type(module))
    if names is None:
        names = _POSITIONAL_NAMES[type(module)] = _positional_names(type(module).forward)
    return {**dict(zip(names, args)), **kwargs}


def _positional_names(forward) -> tuple[str, ...]:
    # the names that positional arguments after ``self`` take, up to a ``*args``
    names = []
    for parameter in list(inspect.signature(forward).parameters.values())[1:]:
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        names.append(parameter.name)
    return tuple(names)
