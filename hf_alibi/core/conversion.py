"""Converting a model in place (:func:`convert`) and the ``Alibi<Class>`` classes that rebuild checkpoints."""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .architectures import Architecture, check_strategy, find_architecture
from .batching import make_manager, paged_batch
from .bias import AlibiBias
from .compat import cache_argument, is_exporting, register_recorded_outputs, zeros_unless_loaded
from .config import AlibiConfigMixin, alibi_config_class, alibi_config_copy, get_settings, rebind_config
from .mask import MaskCache, attends
from .names import check_backend
from .packing import document_starts, is_packed
from .settings import AlibiSettings, is_per_layer
from .slopes import CAUSAL, scaled_slopes_list
from .strategies import POSITION_READERS, STRATEGIES, RetainedTable, find_modules


def row_for(settings: AlibiSettings) -> Architecture:
    """The row a converted model is built with: the one saved in its settings, else the one registered here."""
    if settings.architecture is not None:
        return Architecture.from_dict(settings.architecture)
    row = find_architecture(settings.base_model_type)
    if row is None:
        raise ValueError(
            f"This ALiBi checkpoint of {settings.base_model_type!r} records no architecture row, and none is "
            "registered: import hf_alibi, and the code that registered it (hf_alibi.register_architecture), first."
        )
    return row


def apply(model: PreTrainedModel, settings: AlibiSettings, row: Architecture) -> None:
    """The conversion proper, on a model whose config is already ALiBi: the row's strategy removes the
    position path, every self-attention module at the row's ``attention`` paths gets an ``AlibiBias``
    (causal, or the encoder variant where the row is bidirectional and the module is not causal),
    position ids are dropped unless they describe a packed row (whose documents are recorded, see
    ``packing.py``), and the layers share one mask cache for the length of a forward. Checked by the caller
    (:func:`check_fits`): a loaded checkpoint in ``Alibi<Class>.__init__``, a conversion in ``patch_model``."""
    base = model.base_model
    attentions = self_attentions(base, row)
    STRATEGIES[row.strategy](base, row.position, settings)
    masks = MaskCache()
    slopes = scaled_slopes_list(settings.heads, settings.slope_scale, settings.slopes)
    per_layer = slopes if is_per_layer(slopes) else [slopes] * len(attentions)
    for attention, layer_slopes in zip(attentions, per_layer):
        causal = not row.bidirectional or bool(getattr(attention, "is_causal", False))
        kind = CAUSAL if causal else settings.encoder_variant
        attention.alibi = AlibiBias(kind, settings.heads, masks=masks, slopes=layer_slopes, sinks=settings.sinks)
    _alibi_sub_configs(model)
    if any(isinstance(m, RetainedTable) for m in base.modules()):
        _init_retained_tables(model)
    # Around every forward (before_forward, then the masks released: they live for one forward only). The model's
    # own class does it (alibi_model_class); the base model, when it is another module, in hooks: a task head may
    # run the base's forward or its inner stack (OPTForCausalLM calls model.decoder), and a caller the base itself.
    setup = ForwardSetup(masks, any(isinstance(m, POSITION_READERS) for m in base.modules()), settings.sinks)
    model._alibi_forward = setup
    if base is not model:
        base.register_forward_pre_hook(partial(before_forward, setup), with_kwargs=True)
        base.register_forward_hook(masks.release)


@dataclass(frozen=True)
class ForwardSetup:
    """What a converted model's forward reads before it runs: the model's mask cache, whether anything in the
    model reads position ids (a retained table or rotary, ``strategies.POSITION_READERS``), its sinks, and whether
    its bias needs each row's start without sinks (a bias rounded per key, ``slopes.KeyRounding``)."""

    masks: MaskCache
    reads_positions: bool
    sinks: int
    records_rows: bool = False


def before_forward(setup: ForwardSetup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before a forward of a converted model (or its base): the position ids (:func:`_read_position_ids`) and,
    with sinks, where each row starts (:func:`_record_rows`), recorded for this forward."""
    args, kwargs = _read_position_ids(setup.masks, setup.reads_positions, module, args, kwargs)
    if setup.sinks or setup.records_rows:
        _record_rows(setup.masks, module, args, kwargs)
    return args, kwargs


def _init_retained_tables(model: PreTrainedModel) -> None:
    # init_weights() after a meta-device build (FSDP, init_empty_weights) runs the _init_weights of the nearest
    # PreTrainedModel around each module, the base model's for the table: each instance's gets the table too,
    # with the value a build from the config has (zeros until the weights load; loaded values are kept)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and "_init_weights" not in vars(module):
            module._init_weights = partial(_init_weights_and_tables, module._init_weights)


def _init_weights_and_tables(init_weights, module: nn.Module) -> None:
    init_weights(module)
    if isinstance(module, RetainedTable):
        zeros_unless_loaded(module.table)


def self_attentions(base: nn.Module, row: Architecture) -> list[nn.Module]:
    """Every self-attention module of the row's ``attention`` paths under ``base``, in the model's order
    (the order of per-layer slopes)."""
    return [attention for path in row.attention for _, _, attention in find_modules(base, path)]


def check_fits(model: PreTrainedModel, settings: AlibiSettings, row: Architecture) -> None:
    """One-line ``ValueError`` where checked ``settings`` do not fit ``model`` (nothing changed): the row's
    strategy is known here, sinks fit its kind of model, per-layer slopes its layers."""
    check_strategy(row)
    check_sinks_fit(model.config, settings)
    check_slopes_fit(settings, len(self_attentions(model.base_model, row)))


def check_slopes_fit(settings: AlibiSettings, count: int) -> None:
    """One-line ``ValueError`` when per-layer slopes do not list one entry for each of the model's ``count``
    self-attention layers (:func:`self_attentions`)."""
    if is_per_layer(settings.slopes):
        if len(settings.slopes) != count:
            raise ValueError(
                f"slopes lists {len(settings.slopes)} layers, but this {settings.base_model_type} model has {count} "
                f"self-attention layers: give one list of {settings.heads} slopes per layer, or one list for all."
            )


def sinks_fit(config: PretrainedConfig) -> bool:
    """Sinks are placed by the model's one ``attention_mask``: an encoder-decoder has two (not yet)."""
    return not getattr(config, "is_encoder_decoder", False)


def check_sinks_fit(config: PretrainedConfig, settings: AlibiSettings) -> None:
    """One-line ``ValueError`` for sinks on a model they do not fit (:func:`sinks_fit`)."""
    if settings.sinks and not sinks_fit(config):
        raise ValueError(
            f"sinks={settings.sinks} is not supported for encoder-decoder models ({settings.base_model_type}) yet: "
            "its encoder and decoder are padded separately. Use sinks=0."
        )


_POSITIONAL_NAMES: dict[type, tuple[str, ...]] = {}


def _all_layers_slide(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return "full_attention" not in layer_types
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def masks_sinks(module: nn.Module) -> int:
    return next((m.sinks for m in module.modules() if isinstance(m, AlibiBias)), 0)


def _record_rows(masks: MaskCache, module: nn.Module, args: tuple, kwargs: dict) -> None:
    # Sinks are the first real tokens of each row: where the 2D padding mask's ones start (left
    # padding), and the sequence's end (the mask's length: past + new tokens), which places the keys
    # of static caches (more slots than tokens) and sliding caches (fewer). Recorded for this forward.
    if masks.paged() is not None:  # a continuous-batching step: sinks follow each request (batching.py)
        return
    documents = masks.documents()
    if documents is not None:  # a packed row: the first tokens of each document (packing.py)
        masks.set_rows(documents, None)
        return
    values = kwargs if "attention_mask" in kwargs else bound_arguments(module, args, kwargs)
    mask = values.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        masks.set_rows(mask.to(torch.long).argmax(dim=-1), mask.shape[-1])  # argmax: the first 1 of each row
        return
    starts = end = None
    if isinstance(mask, dict):  # one 4D mask per layer type (generate() with a static cache, mixed layers)
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4 and _all_layers_slide(module.config):
        raise ValueError(
            f"sinks={masks_sinks(module)} with a 4D attention mask on a sliding-window model: the mask cannot "
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
    masks.set_rows(starts, end)


def convert(model: PreTrainedModel, settings: AlibiSettings, row: Architecture, alibi_class: type) -> None:
    """Convert ``model`` in place (validated by the caller): its config becomes an ALiBi copy, its
    class ``alibi_class``, then :func:`apply`."""
    config = model.config
    new_config = alibi_config_copy(config, alibi_class.config_class, settings.to_dict())
    rebind_config(model, config, new_config)
    model.__class__ = alibi_class
    # transformers keys what a model records (hidden states, attentions) on its class: the new one too
    register_recorded_outputs(model)
    apply(model, settings, row)


def _alibi_sub_configs(model: PreTrainedModel) -> None:
    # Submodules may hold copies of the model's config (T5's stacks, with is_decoder set); transformers
    # reads the attention implementation from those, so each gets an ALiBi copy of its own.
    config = model.config
    base_class = next(
        c for c in type(config).__mro__[1:] if issubclass(c, PretrainedConfig) and not issubclass(c, AlibiConfigMixin)
    )
    copies: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        old = getattr(module, "config", None)
        if old is None or old is config or not isinstance(old, base_class):
            continue
        if id(old) not in copies:
            copies[id(old)] = alibi_config_copy(old, type(config), config.alibi)
        module.config = copies[id(old)]


def _read_position_ids(
    masks: MaskCache, reads_positions: bool, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    # ALiBi has no position index, so position ids are dropped (the model counts positions from its cache, as
    # without ids), with three exceptions: ids that restart at the row's first id, with no attention mask and no
    # cache to continue, are a packed row (transformers' padding-free format). Its documents are recorded for this
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
        masks.set_documents(None)
        return args, kwargs
    # the cache by name (how transformers passes it), else among the positional arguments
    cache = cache_argument(kwargs)
    if cache is None and args:
        cache = cache_argument(bound_arguments(module, args, kwargs))
    batch = None if tracing else paged_batch(cache, kwargs)
    starts = None
    if position_ids is not None and batch is None:
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
    if tracing:
        masks.set_documents(starts)
    else:
        masks.begin(starts, batch)
    return args, kwargs


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


@contextmanager
def _placeholder_sizes(config, names: tuple[str, ...], size: int):
    saved = {name: getattr(config, name) for name in names}
    for name in names:
        setattr(config, name, size)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


_MODEL_CLASSES: dict[tuple[type, str], type] = {}


def alibi_model_class(base_cls: type[PreTrainedModel], config_cls: type, module: str, bases: tuple = ()) -> type:
    """``Alibi<Class>``: ``base_cls`` built from an ALiBi config, then converted (made once per module).

    Its ``__init__`` builds the original model (the removed config fields hold a placeholder size,
    since the original still builds the path it then loses) and applies the saved row, so
    ``from_pretrained`` loads the weights into the converted model. ``bases`` go before ``base_cls``
    (hf_alibi adds the mixin that writes remote code on save).
    """
    cls = _MODEL_CLASSES.get((base_cls, module))
    if cls is not None:
        return cls

    def __init__(self, config, *args, **kwargs):
        settings = get_settings(config)
        row = row_for(settings)
        with _placeholder_sizes(config, config.alibi_removed_fields(), row.placeholder_size(config)):
            base_cls.__init__(self, config, *args, **kwargs)
        check_fits(self, settings, row)
        apply(self, settings, row)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        # transformers writes the stored name past the config's setter: check it first, so a refused name
        # leaves the model as it was
        names = attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]
        for name in names:
            if isinstance(name, str):
                check_backend(name)
        return super(cls, self).set_attn_implementation(attn_implementation, *args, **kwargs)

    @functools.wraps(base_cls.forward)  # the original's signature (transformers and the Trainer inspect it)
    def forward(self, *args, **kwargs):
        # the conversion's bookkeeping around every forward (``apply``), in the class rather than a hook: PEFT's
        # AdaLoRA calls ``model.forward`` directly, past any hook
        setup = self._alibi_forward
        args, kwargs = before_forward(setup, self, args, kwargs)
        try:
            return super(cls, self).forward(*args, **kwargs)
        finally:
            setup.masks.release()  # also when the forward raised

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        # generate_batch, continuous_batching_context_manager and `transformers serve --continuous-batching` start
        # here: transformers' manager would refuse the alibi_<backend> name (or switch to flash); this one runs the
        # bias through the paged cache, or refuses in one line (batching.py)
        return make_manager(self, generation_config, continuous_batching_config, workload_hints)

    name = "Alibi" + base_cls.__name__
    cls = type(
        name,
        (*bases, base_cls),
        {
            "__init__": __init__,
            "forward": forward,
            "set_attn_implementation": set_attn_implementation,
            "init_continuous_batching": init_continuous_batching,
            "config_class": config_cls,
            # engines that run transformers models through their own attention function (vLLM's and SGLang's
            # transformers backends) check this: theirs would drop the bias, so they refuse with their message
            "_supports_attention_backend": False,
            "__module__": module,
            "__qualname__": name,
            "__doc__": f"{base_cls.__name__} with ALiBi instead of position embeddings (made by hf_alibi).",
        },
    )
    _MODEL_CLASSES[(base_cls, module)] = cls
    return cls


def class_by_name(name: str, module: str) -> type:
    """``AlibiGPT2LMHeadModel``, ``AlibiGPT2Config``, ...: made from transformers' class of that name.

    What the entry module of a checkpoint answers for the names ``auto_map`` gives. A config class of a
    type without a row registered in this process (always so in remote code) finds its removed fields
    in config.json (see ``alibi_config_class``).
    """
    base = getattr(transformers, name.removeprefix("Alibi"), None) if name.startswith("Alibi") else None
    if not isinstance(base, type) or not issubclass(base, (PretrainedConfig, PreTrainedModel)):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    config_base = base if issubclass(base, PretrainedConfig) else base.config_class
    row = find_architecture(config_base.model_type)
    removed = row.removed_config_fields if row is not None else None
    config_cls = alibi_config_class(config_base, config_base.model_type, removed, module)
    return config_cls if base is config_base else alibi_model_class(base, config_cls, module)
