"""Every private transformers API a loaded checkpoint runs, each with the versions it was checked on (the server's
are in ``serve/compat.py``, saving's in ``hub/compat.py``: a checkpoint's remote code copies this file, not those).

Last checked on transformers 5.19.0 and 5.24.0, torch 2.13.0 (the ranges below say since when each holds).

A transformers release that moves one of these breaks only the compat modules. Public APIs (the attention and
mask interfaces' ``register``, ``PreTrainedModel``, the Auto classes) are imported where they are used.
"""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

# Checked on transformers 5.0 to 5.24 (last on 5.19.0 and 5.24.0): integrations/sdpa_attention.py's grouped-KV
# helper, (B, H_kv, L, D) -> (B, H_kv * n_rep, L, D).
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: F401  (re-exported)
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.auto import modeling_auto

# The Auto classes an ALiBi model can be loaded with, when transformers maps the base type there.
AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMultipleChoice",
    "AutoModelForPreTraining",
    "AutoModelForNextSentencePrediction",
    "AutoModelForTextEncoding",
)


def auto_class_names(model_type: str) -> dict[str, str]:
    """transformers' Auto class name -> model class name for one ``model_type``.

    Reads ``_LazyAutoMapping._model_mapping`` (the static name table; checked on 5.0 to 5.24, last on 5.19.0 and
    5.24.0), which lists classes by name without importing every model.

    >>> auto_class_names("gpt2")["AutoModelForCausalLM"]
    'GPT2LMHeadModel'
    """
    classes = {}
    for auto_name in AUTO_CLASSES:
        class_name = getattr(modeling_auto, auto_name)._model_mapping._model_mapping.get(model_type)
        if isinstance(class_name, str):
            classes[auto_name] = class_name
    return classes


def base_mask_function(backend: str):
    """transformers' own mask function for ``backend`` (``AttentionMaskInterface._global_mapping``,
    checked on 5.0 to 5.24, last on 5.19.0 and 5.24.0), or ``None`` when it has none."""
    return AttentionMaskInterface._global_mapping.get(backend)


class AttnImplementationOverride:
    """Config mixin: rewrites the attention implementation that transformers dispatches on.

    transformers reads ``config._attn_implementation`` (a private property of ``PretrainedConfig``;
    checked on transformers 5.19.0, 5.23.0 and 5.24.0, torch 2.13.0) to pick the attention and the mask function.
    Here it answers ``self.reported_attn_implementation(stored)``, and a value set is stored as
    ``self.accepted_attn_implementation(value)`` through ``PretrainedConfig``'s own setter (which also
    sets the sub-configs).
    """

    # stored name -> reported name for the names whose answer never changes, read first (a subclass fills its own)
    reported_names: dict[str, str] = {}

    def reported_attn_implementation(self, stored: str | dict | None) -> str | dict | None:
        return stored

    def accepted_attn_implementation(self, value: str | dict | None) -> str | dict | None:
        return value

    @property
    def _attn_implementation(self):
        # read by every attention layer at every step: the stored value read here directly, the memo and the method
        # found on the class (a config's own attribute lookup is Python code in transformers)
        stored = self._attn_implementation_internal
        reported = type(self).reported_names.get(stored) if type(stored) is str else None
        return type(self).reported_attn_implementation(self, stored) if reported is None else reported

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        PretrainedConfig._attn_implementation.fset(self, self.accepted_attn_implementation(value))


def stored_attn_implementation(config: PretrainedConfig) -> str | dict | None:
    """What that setter stored (``_attn_implementation_internal``; checked on transformers 5.0 to 5.24, last on
    5.19.0 and 5.24.0)."""
    return config._attn_implementation_internal


def store_attn_implementation(config: PretrainedConfig, value: str | None) -> None:
    """Write ``_attn_implementation_internal`` directly, without the setter (so the sub-configs keep
    theirs; checked on transformers 5.19.0, 5.23.0 and 5.24.0)."""
    config._attn_implementation_internal = value


def attn_implementation(config: PretrainedConfig) -> str | dict | None:
    """The attention backend transformers dispatches on (``PretrainedConfig._attn_implementation``, a private
    property; checked on transformers 5.19.0, 5.23.0 and 5.24.0)."""
    return config._attn_implementation


def assign_attn_implementation(config: PretrainedConfig, value: str | None) -> None:
    """Set ``config._attn_implementation`` through ``PretrainedConfig``'s setter (the sub-configs too), without a
    model's ``set_attn_implementation`` checks (checked on transformers 5.19.0 and 5.24.0)."""
    config._attn_implementation = value


# Class attributes of a model class whose module source does not show transformers' attention interface (its
# attention modules replaced on the instance): ``PreTrainedModel._can_set_attn_implementation`` reads the class's
# source to decide whether ``set_attn_implementation`` may switch it, unless
# ``_can_set_attn_implementation_cached_value`` is a bool (checked on transformers 5.19.0 and 5.24.0).
ATTN_IMPLEMENTATION_SETTABLE = {"_can_set_attn_implementation_cached_value": True}


def stored_output_attentions(config: PretrainedConfig) -> bool | None:
    """Where ``PretrainedConfig.output_attentions`` (a property) keeps its value: ``_output_attentions``
    (checked on transformers 5.19.0, 5.23.0 and 5.24.0; ``to_dict`` writes it as ``output_attentions``)."""
    return config._output_attentions


def submodels_set_attn_implementation_skips(model) -> list:
    """The submodels (``PreTrainedModel`` with a config object of their own) whose config ``model``'s
    ``set_attn_implementation`` leaves as it was: before 5.24 (checked on 5.19.0) it skips those whose config is of
    the model's config class (T5's encoder and decoder stacks, which hold copies of it); 5.24 sets every one (checked
    on 5.24.0)."""
    config = model.config
    return [
        module for module in model.modules()
        if module is not model and isinstance(module, PreTrainedModel) and module.config is not config
        and type(module.config) is type(config)
    ]  # fmt: skip


def store_output_attentions(config: PretrainedConfig, value: bool) -> None:
    """Set ``_output_attentions`` without ``PretrainedConfig``'s checks (checked on transformers 5.19.0, 5.23.0 and
    5.24.0)."""
    config._output_attentions = value


def drop_config_validators(config_class: type, names: tuple[str, ...] | None) -> None:
    """Remove the strict dataclass validators of ``names`` (``None``: all) from ``config_class``
    (huggingface_hub's ``strict`` configs keep them in ``__validators__``, read on every assignment;
    checked on transformers 5.0 to 5.24, last on 5.19.0 and 5.24.0), so a removed field may hold ``None`` or the
    marker string."""
    validators = getattr(config_class, "__validators__", None)
    if validators is not None:
        config_class.__validators__ = {k: v for k, v in validators.items() if names is not None and k not in names}


def config_class_validators(config_class: type) -> list:
    """The class validators (``validate_*`` methods) that ``PretrainedConfig.validate`` runs for
    ``config_class`` (huggingface_hub's ``strict`` keeps them in ``__class_validators__`` of the
    decorated class; checked on transformers 5.19.0, 5.23 and 5.24.0 with huggingface_hub 2.4), ``[]`` where there
    are none."""
    return list(getattr(config_class, "__class_validators__", ()))


def flash_padding_helpers():
    """``(_upad_input, _unpad_input, _pad_input)`` of ``modeling_flash_attention_utils`` (checked on
    5.0 to 5.24, last on 5.19.0 and 5.24.0): unpad a padded batch for ``flash_attn_varlen_func`` and pad its output
    back."""
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input, _upad_input

    return _upad_input, _unpad_input, _pad_input


def compiled_flex_attention(training: bool):
    """transformers' compiled FlexAttention (``integrations.flex_attention.WrappedFlexAttention``,
    checked on 5.0 to 5.24, last on 5.19.0 and 5.24.0): one compiled function per process."""
    from transformers.integrations.flex_attention import WrappedFlexAttention

    return WrappedFlexAttention(training)()


def cpu_flash_attention():
    """torch's CPU flash-attention op (``aten._scaled_dot_product_flash_attention_for_cpu``, private;
    checked on torch 2.4 to 2.13), which takes ``is_causal`` and a broadcast float mask at once, or
    ``None`` where this torch has none. Returns ``(output (B, H, q, D), logsumexp)``."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_flash_attention_shares_kv_heads() -> bool:
    """Whether that op takes fewer key/value heads than query heads (grouped KV) itself: torch >= 2.5."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def register_recorded_outputs(model) -> None:
    """Tell transformers' output recording what ``model`` records after its class changed.

    ``capture_outputs`` (``output_hidden_states``, ``output_attentions``, ...) looks the model's
    ``_can_record_outputs`` up in ``utils.output_capturing._CAN_RECORD_REGISTRY``, keyed on
    ``str(model.__class__)`` and filled by ``PreTrainedModel.__init__``: a model whose class is swapped
    after ``__init__`` (``Alibi<Class>``) is missing there and records nothing. On 5.23 and 5.24 (checked on
    5.24.0) the registry is a dict subclass whose ``__setitem__`` takes the model and makes the key itself;
    on 5.19 (checked on 5.19.0) a plain dict, where the caller writes the key. Older releases without
    the registry read the class attribute itself and need nothing.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    key = str(model.__class__) if type(_CAN_RECORD_REGISTRY) is dict else model
    _CAN_RECORD_REGISTRY[key] = model._can_record_outputs


def supports_sdpa(model_class: type) -> bool:
    """What ``Alibi<Class>`` answers for ``_supports_sdpa``, which ``PreTrainedModel`` reads to load a model on sdpa
    when no attention is asked for: its original's, unless the type's config soft-caps attention scores by default
    (``attn_logit_softcapping``), which sdpa cannot do. transformers 5.24 says False for such types itself (Gemma 2;
    checked on 5.24.0); 5.19 says True for Gemma 2 (checked on 5.19.0), whose sdpa then drops the cap, and hf_alibi's
    sdpa refuses it: such a model loads on eager on both."""
    soft_caps = getattr(getattr(model_class, "config_class", None), "attn_logit_softcapping", None) is not None
    return bool(model_class._supports_sdpa) and not soft_caps


# A model's forward takes its KV cache as ``cache`` from transformers 5.24 on (``past_key_values`` and
# ``cache_params`` still accepted and renamed inside the forward, after the pre-hooks ran); before, as
# ``past_key_values``. Checked on 5.19.0, 5.23.0 and 5.24.0.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(arguments: dict):
    """The KV cache among a forward's keyword ``arguments`` under any of its names, else ``None``."""
    for name in CACHE_ARGUMENTS:  # a loop, not a generator: this runs before every forward
        cache = arguments.get(name)
        if cache is not None:
            return cache
    return None


def torch_openmp_library() -> str | None:
    """The GNU OpenMP runtime torch's CPU kernels run their threads on: the ``libgomp.so.1`` that Linux wheels
    bundle in ``torch/lib`` (checked on torch 2.13 CPU), or ``None`` (another runtime, another layout)."""
    import os

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    return path if os.path.exists(path) and "OpenMP" in torch.__config__.parallel_info() else None


def zeros_unless_loaded(tensor: torch.Tensor) -> torch.Tensor:
    """Zero ``tensor`` unless transformers marked it loaded from a checkpoint: ``transformers.initialization.zeros_``
    (what ``_init_weights`` must use so that ``from_pretrained`` keeps the loaded values; checked on 5.19, 5.23 and
    5.24)."""
    from transformers import initialization

    return initialization.zeros_(tensor)


# True while ``torch.export`` / dynamo traces (``torch.compiler.is_compiling``, public since torch 2.3). The function
# itself, not a wrapper: it is asked in the hot loop of generation, and dynamo answers it while it traces.
is_exporting = torch.compiler.is_compiling


# transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers serve
# --continuous-batching``), checked on transformers 5.19.0 and 5.24.0: each forward gets ``cache=`` a
# ``PagedAttentionCache`` (no ``get_seq_length``), ``position_ids`` per token, ``cu_seq_lens_q``, ``cu_seq_lens_k`` per
# layer type (cut to the layer's own by ``PagedAttentionCache.update``, called by the attention layer from 5.24 and by
# the attention function before: :func:`update_paged_cache_in_attention`; it gathers each request's keys in position
# order, ending with its new tokens), and no attention mask unless the name is exactly "sdpa" / "paged|eager".


def is_paged_cache(cache) -> bool:
    """Whether ``cache`` is continuous batching's ``PagedAttentionCache`` (public name; 5.19.0 and 5.24.0)."""
    kind = type(cache)
    paged = _PAGED_TYPES.get(kind)  # asked before every forward: the answer kept per type (an ABC check is slow)
    if paged is None:
        paged = _PAGED_TYPES[kind] = issubclass(kind, _paged_cache_class())
    return paged


_PAGED_TYPES: dict[type, bool] = {}


@functools.cache
def _paged_cache_class() -> type:
    # imported on first use (continuous batching's module is not needed to convert a model), then kept: this runs
    # before every forward
    from transformers.generation.continuous_batching import PagedAttentionCache

    return PagedAttentionCache


def update_paged_cache_in_attention(module, key: torch.Tensor, value: torch.Tensor, kwargs: dict):
    """``(key, value)`` of this attention call, written to continuous batching's paged cache and read back with each
    request's cached keys where the call itself must do it (``kwargs`` narrowed in place to the layer's own
    ``cu_seq_lens_k`` / ``max_length_k``, the cache taken out of them), else as given.

    Before transformers 5.24 (checked on 5.19.0) a model's forward takes continuous batching's cache in its
    ``**kwargs`` as ``cache`` (its own argument is ``past_key_values``) and hands it down to the attention
    function, where transformers' sdpa and paged|eager functions call ``cache.update(key, value, layer_idx,
    kwargs)``. From 5.24 on (checked on 5.24.0) the attention layer calls it, with its cache argument ``cache``,
    and no cache reaches the attention function."""
    cache = kwargs.get("cache")
    if cache is None or not is_paged_cache(cache):
        return key, value
    del kwargs["cache"]  # the kernels must not write it again (5.19's sdpa would)
    return cache.update(key, value, module.layer_idx, kwargs)


def paged_layer_window(cache, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` in a ``PagedAttentionCache`` (its allocator's ``sliding_window``,
    found through ``layer_to_allocator``; checked on 5.19.0 and 5.24.0), ``None`` for a full-attention layer."""
    return getattr(cache.layer_to_allocator[layer_idx], "sliding_window", None)


@functools.cache
def continuous_batching_manager_class() -> type:
    """transformers' ``ContinuousBatchingManager``, whose ``__init__`` calls ``self.switch_to_cb_friendly_attn(model,
    auto_switch_to_flash)`` (the check of the attention implementation's name) and then resolves
    ``self.continuous_batching_config`` (compile, CUDA graphs); ``ContinuousMixin.init_continuous_batching`` returns
    a cached ``_cached_continuous_batching_manager`` after calling that same method. Checked on 5.19.0 and 5.24.0.

    Subclassed once here: its private ``_create_batch_processor`` runs inside ``self.making_batch_processor()``, a
    context manager a subclass may override (default: nothing around it)."""
    import contextlib

    from transformers import ContinuousBatchingManager

    class Manager(ContinuousBatchingManager):
        def making_batch_processor(self):
            return contextlib.nullcontext()

        def _create_batch_processor(self):
            with self.making_batch_processor():
                return super()._create_batch_processor()

    return Manager


def cached_continuous_batching_manager(model):
    """The manager ``init_continuous_batching`` cached on ``model`` (``_cached_continuous_batching_manager``; checked
    on 5.19.0 and 5.24.0), else ``None``."""
    return getattr(model, "_cached_continuous_batching_manager", None)


# The attention names for which transformers' continuous batching allocates a dense ``(1, 1, max_batch_tokens,
# max_tokens_read + max_batch_tokens)`` mask per layer kind and fills it at every reset of its inputs
# (``continuous_batching.utils.attn_mask_is_needed``, read once, when the batch processor is made; 5.19.0 and
# 5.24.0): with the default sizes about 9.5 GB for any model. hf_alibi's paged path builds its own mask (batching.py).
CONTINUOUS_BATCHING_DENSE_MASK_NAMES = ("paged|eager", "sdpa")

__all__ = [
    "ATTN_IMPLEMENTATION_SETTABLE",
    "AUTO_CLASSES",
    "assign_attn_implementation",
    "attn_implementation",
    "cached_continuous_batching_manager",
    "GradientCheckpointingOverride",
    "CONTINUOUS_BATCHING_DENSE_MASK_NAMES",
    "AttnImplementationOverride",
    "auto_class_names",
    "base_mask_function",
    "cache_argument",
    "compiled_flex_attention",
    "continuous_batching_manager_class",
    "cpu_flash_attention",
    "config_class_validators",
    "cpu_flash_attention_shares_kv_heads",
    "drop_config_validators",
    "flash_padding_helpers",
    "is_exporting",
    "is_paged_cache",
    "paged_layer_window",
    "register_recorded_outputs",
    "repeat_kv",
    "store_attn_implementation",
    "store_output_attentions",
    "submodels_set_attn_implementation_skips",
    "supports_sdpa",
    "torch_openmp_library",
    "update_paged_cache_in_attention",
    "zeros_unless_loaded",
    "stored_attn_implementation",
    "stored_output_attentions",
]


# ---------------------------------------------------------------------------------------------------------------
# The native models' private uses (hf_alibi/native/); the server's are in hf_alibi/serve/compat.py, saving's in
# hf_alibi/hub/compat.py (a checkpoint's remote code copies this file: only what a loaded model runs is here).


def block_mask_free_generate_masks():
    """A ``create_masks_for_generate`` method for a model class where transformers' ``generate()`` cannot take the
    mask that function makes, else ``None``.

    ``generate()`` makes a static cache's mask in advance with the model's ``create_masks_for_generate`` (else
    ``masking_utils.create_masks_for_generate``) and, before 5.24 (checked on 5.19.0), calls ``.contiguous()`` on it,
    which flex_attention's ``BlockMask`` has not (transformers' own Llama on flex fails so with a static cache); 5.24
    passes what is not a tensor on (checked on 5.24.0). The method gives the BlockMask's boolean mask in its place,
    ``(B, 1, q, kv)`` (True where a query attends), which hf_alibi's flex path takes as well."""
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (5, 24):
        return None
    from transformers.masking_utils import create_masks_for_generate

    def masks_for_generate(self, *args, **kwargs):
        from torch.nn.attention.flex_attention import BlockMask, create_mask

        mask = create_masks_for_generate(*args, **kwargs)
        if not isinstance(mask, BlockMask):
            return mask
        batch, device = mask.kv_num_blocks.shape[0], mask.kv_num_blocks.device
        return create_mask(mask.mask_mod, batch, None, *mask.seq_lengths, device=device)

    return masks_for_generate


__all__ += ["block_mask_free_generate_masks"]


class GradientCheckpointingOverride:
    """Model mixin: transformers' gradient checkpointing (``PreTrainedModel._set_gradient_checkpointing``, private;
    checked on transformers 5.19 and 5.24) runs every checkpointed call through ``self.checkpoint_function(function)``
    (default: the function as given)."""

    @staticmethod
    def checkpoint_function(function):
        return function

    def _set_gradient_checkpointing(self, *args, **kwargs):
        args, kwargs = with_checkpoint_function(args, kwargs, self.checkpoint_function)
        return super()._set_gradient_checkpointing(*args, **kwargs)


def with_checkpoint_function(args: tuple, kwargs: dict, wrap) -> tuple[tuple, dict]:
    """The arguments of ``PreTrainedModel._set_gradient_checkpointing(enable, gradient_checkpointing_func,
    every_n_layers)`` with the checkpointing function replaced by ``wrap(function)``; transformers' default is
    ``torch.utils.checkpoint.checkpoint``. Checked on transformers 5.19 and 5.24 (activation_checkpointing_enable
    passes the function by name, a ``functools.partial`` of ``checkpoint`` with the user's keyword arguments)."""
    if "gradient_checkpointing_func" in kwargs:
        return args, {**kwargs, "gradient_checkpointing_func": wrap(kwargs["gradient_checkpointing_func"])}
    if len(args) > 1:
        return (args[0], wrap(args[1]), *args[2:]), kwargs
    from torch.utils.checkpoint import checkpoint

    return args, {**kwargs, "gradient_checkpointing_func": wrap(checkpoint)}
