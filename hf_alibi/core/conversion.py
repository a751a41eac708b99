"""Converting a model in place (:func:`convert`) and the ``Alibi<Class>`` classes that rebuild checkpoints."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from functools import partial

import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .architectures import Architecture, check_strategy, find_architecture
from .batching import make_manager
from .bias import AlibiBias
from .compat import (
    register_recorded_outputs,
    store_attn_implementation,
    stored_attn_implementation,
    submodels_set_attn_implementation_skips,
    supports_sdpa,
    zeros_unless_loaded,
)
from .config import AlibiConfigMixin, alibi_config_class, alibi_config_copy, get_settings, rebind_config
from .forward import (  # noqa: F401  (ForwardSetup, bound_arguments: what pickles and imports named here)
    CheckpointsInForward,
    ForwardSetup,
    SharedByLayers,
    bound_arguments,
    call_forward,
    hook_base,
)
from .names import base_name, check_backend
from .settings import AlibiSettings, is_per_layer
from .slopes import CAUSAL
from .strategies import POSITION_READERS, STRATEGIES, RetainedTable, find_modules
from .window import rotary_window


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
    ``packing.py``), and each forward hands its layers what they read of it (``forward.py``). Checked by the caller
    (:func:`check_fits`): a loaded checkpoint in ``Alibi<Class>.__init__``, a conversion in ``patch_model``."""
    base = model.base_model
    attentions = self_attentions(base, row)
    STRATEGIES[row.strategy](base, row.position, settings)
    shared = SharedByLayers()
    slopes = settings.slopes_in_use()
    per_layer = slopes if is_per_layer(slopes) else [slopes] * len(attentions)
    window = rotary_window(base, settings)
    for attention, layer_slopes in zip(attentions, per_layer):
        causal = not row.bidirectional or bool(getattr(attention, "is_causal", False))
        kind = CAUSAL if causal else settings.encoder_variant
        attention.alibi = AlibiBias(kind, settings.heads, shared=shared, slopes=layer_slopes, sinks=settings.sinks)
        attention.alibi.window = window
    _alibi_sub_configs(model)
    if any(isinstance(m, RetainedTable) for m in base.modules()):
        _init_retained_tables(model)
    # Before every forward, its AlibiForward (forward.py). The model's own class makes it (alibi_model_class); the
    # base model, when it is another module, in hooks: a task head may run the base's forward or its inner stack
    # (OPTForCausalLM calls model.decoder), and a caller the base itself.
    reads_positions = any(isinstance(m, POSITION_READERS) for m in base.modules())
    # a window places its far pairs by the sequence's end (a static cache's keys): recorded for it as for sinks
    setup = ForwardSetup(shared, reads_positions, settings.sinks, records_rows=window is not None)
    model._alibi_setup = setup
    if base is not model:
        hook_base(base, setup)


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
    stored = stored_attn_implementation(model.config)
    if not alibi_class._supports_sdpa and isinstance(stored, str) and base_name(stored) == "sdpa":
        # the original was loaded on sdpa where transformers allows it but the scores are soft-capped (Gemma 2 on
        # transformers 5.19, whose sdpa drops the cap): eager, which from_pretrained picks for the converted class
        model.set_attn_implementation("eager")


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
        result = super(cls, self).set_attn_implementation(attn_implementation, *args, **kwargs)
        if isinstance(attn_implementation, str):  # what transformers 5.24 does itself (T5's stacks)
            for module in submodels_set_attn_implementation_skips(self):
                store_attn_implementation(module.config, stored_attn_implementation(self.config))
        return result

    @functools.wraps(base_cls.forward)  # the original's signature (transformers and the Trainer inspect it)
    def forward(self, *args, **kwargs):
        # the conversion's bookkeeping around every forward (``apply``), in the class rather than a hook: PEFT's
        # AdaLoRA calls ``model.forward`` directly, past any hook
        return call_forward(self._alibi_setup, self, super(cls, self).forward, args, kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        # generate_batch, continuous_batching_context_manager and `transformers serve --continuous-batching` start
        # here: transformers' manager would refuse the alibi_<backend> name (or switch to flash); this one runs the
        # bias through the paged cache, or refuses in one line (batching.py)
        return make_manager(self, generation_config, continuous_batching_config, workload_hints)

    name = "Alibi" + base_cls.__name__
    cls = type(
        name,
        (*bases, CheckpointsInForward, base_cls),
        {
            "__init__": __init__,
            "forward": forward,
            "set_attn_implementation": set_attn_implementation,
            "init_continuous_batching": init_continuous_batching,
            "config_class": config_cls,
            # engines that run transformers models through their own attention function (vLLM's and SGLang's
            # transformers backends) check this: theirs would drop the bias, so they refuse with their message
            "_supports_attention_backend": False,
            "_supports_sdpa": supports_sdpa(base_cls),  # loaded on eager where the scores are soft-capped
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
