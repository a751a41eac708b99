"""The classes a native row's model and attention modules become (made once per original class and row, picklable
by what made them), and what such a model runs with: the backends of the kernel table that render its bias."""

from __future__ import annotations

import functools
import inspect

from torch import nn
from transformers import PreTrainedModel

from ..core.batching import LAYER_ARGUMENTS, make_manager
from ..core.bias import AlibiBias
from ..core.compat import ATTN_IMPLEMENTATION_SETTABLE, block_mask_free_generate_masks
from ..core.forward import KEYWORD, CheckpointsInForward, bound_arguments, call_forward
from ..core.kernels import KERNELS, SUPPORT_FLAGS, kernel_refusal, refusal
from ..core.names import check_backend
from ..core.slopes import CAUSAL
from .attention import NativeAlibiAttention, boolean_causal_mask
from .rows import NativeArchitecture

# where the classes made here say they live: the package, whose names users import (pickle finds them by
# _native_instance, not by this name)
PUBLIC_MODULE = "hf_alibi.native"
_ATTENTION_CLASSES: dict[tuple[type, NativeArchitecture], type] = {}
_MODEL_CLASSES: dict[tuple[type, NativeArchitecture], type] = {}


def _attention_class(original: type, row: NativeArchitecture) -> type:
    cls = _ATTENTION_CLASSES.get((original, row))
    if cls is None:
        parameters = list(inspect.signature(original.forward).parameters.values())[2:]  # after self, hidden_states
        names = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        name = "Alibi" + original.__name__
        cls = _ATTENTION_CLASSES[(original, row)] = type(
            name,
            (NativeAlibiAttention, original),
            {
                "_native_row": row, "_native_arguments": names, "_native_original": original,
                "__reduce_ex__": _reduce_native, "__module__": PUBLIC_MODULE, "__qualname__": name,
            },
        )  # fmt: skip
    return cls


def _reduce_native(self, protocol):
    # pickle (torch.save of the whole model, deepcopy) finds the classes made here by what made them: the original
    # class and the row, both importable
    state = super(type(self), self).__reduce_ex__(protocol)[2]
    kind = "model" if isinstance(self, PreTrainedModel) else "attention"
    return _native_instance, (kind, type(self)._native_original, type(self)._native_row), state


def _native_instance(kind: str, original: type, row: NativeArchitecture):
    """An empty instance of the class :func:`_model_class` or :func:`_attention_class` makes for ``original`` and
    ``row`` (unpickling fills it)."""
    cls = (_model_class if kind == "model" else _attention_class)(original, row)
    return cls.__new__(cls)


def _model_class(original: type, row: NativeArchitecture) -> type:
    # The model's own name, so that save_pretrained writes the original ``architectures``; transformers' flags let
    # set_attn_implementation reach every backend hf_alibi has a path for (the module's source reads as eager only).
    cls = _MODEL_CLASSES.get((original, row))
    if cls is not None:
        return cls

    @functools.wraps(original.forward)  # the original's signature (transformers and the Trainer inspect it)
    def forward(self, *args, **kwargs):
        # in the class, not a hook: PEFT's AdaLoRA calls model.forward past any hook. Position ids that restart
        # (a packed row) are recorded for this forward, so every path keeps the documents apart
        def prepare(forward, args, kwargs):
            if forward is not None and forward.paged is not None:
                kwargs = without_paged_cache(kwargs)
            if forward is not None:
                record_attentions(self, forward, args, kwargs)
            if row.boolean_mask and self.base_model is self:  # else the base's pre-hook does it
                args, kwargs = boolean_causal_mask(self, args, kwargs)
            return args, kwargs

        # the blocks drop keyword arguments: the attention reads the running forward (core/forward.py)
        return call_forward(self._alibi_setup, self, super(cls, self).forward, args, kwargs, prepare)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        for name in attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]:
            if isinstance(name, str):
                check_backend(name, what_runs(self))
                # before the model is switched: what the kernel would refuse (the kernel table's row)
                reason = kernel_refusal(name, model_bias(self))
                if reason is not None:
                    raise ValueError(reason)
        return super(cls, self).set_attn_implementation(attn_implementation, *args, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        # generate_batch, its context manager and transformers serve's continuous batching start here: the manager
        # that keeps the backend (sdpa or eager) and runs the bias through the paged cache (batching.py)
        return make_manager(self, generation_config, continuous_batching_config, workload_hints)

    # generate() with a static cache on flex, where the release cannot take flex's mask made in advance
    masks_for_generate = block_mask_free_generate_masks()
    extra = {} if masks_for_generate is None else {"create_masks_for_generate": masks_for_generate}
    backends = rendering_backends(row)
    cls = _MODEL_CLASSES[(original, row)] = type(
        original.__name__,
        (CheckpointsInForward, original),
        {
            **extra,
            "forward": forward,
            "set_attn_implementation": set_attn_implementation,
            "init_continuous_batching": init_continuous_batching,
            # transformers' per-backend flags, read off the kernel table: a flag is set where one of its backends
            # renders this row's bias (Falcon's rounded bias: no flash kernel)
            **{flag: any(name in backends for name in names) for flag, names in SUPPORT_FLAGS.items()},
            **ATTN_IMPLEMENTATION_SETTABLE,
            # engines that run transformers models through their own attention function would drop the bias
            "_supports_attention_backend": False,
            "_native_original": original,
            "_native_row": row,
            "__reduce_ex__": _reduce_native,
            "__module__": PUBLIC_MODULE,
            "__qualname__": original.__name__,
        },
    )
    return cls


def record_attentions(model: nn.Module, forward, args: tuple, kwargs: dict) -> None:
    """Whether the call of ``model`` (the model or its base) asks for attention weights (its ``output_attentions``,
    else its config's), recorded on its :class:`~hf_alibi.core.forward.AlibiForward`: MPT's blocks do not tell their
    attention, which reads it there."""
    wanted = bound_arguments(model, args, kwargs).get("output_attentions")
    forward.attentions = bool(model.config.output_attentions if wanted is None else wanted)


def _record_base_attentions(base: nn.Module, args: tuple, kwargs: dict) -> None:
    # a base model called directly (past its task head): its pre-hook put the forward in its keyword arguments
    if (forward := kwargs.get(KEYWORD)) is not None:
        record_attentions(base, forward, args, kwargs)


def rendering_backends(row: NativeArchitecture, bias: AlibiBias | None = None) -> tuple[str, ...]:
    """The backends with an ALiBi path whose kernel renders ``row``'s bias (causal, no sinks, its per-key rounding),
    or with ``bias`` (a layer's :class:`~hf_alibi.core.bias.AlibiBias` of a patched model) that layer's: its slopes
    too (MPT's for a head count not a power of two, or an ``alibi_bias_max`` other than 8, are not the paper's, which
    cuDNN's ALiBi alone applies). Asked of the kernel table's rows, the one place a kernel's abilities are written,
    with what :func:`~hf_alibi.core.kernels.kernel_refusal` reads of a layer, as ``set_attn_implementation`` asks."""
    if bias is None:
        return tuple(k.name for k in KERNELS if k.runs and refusal(k, CAUSAL, 0, row.key_rounding) is None)
    form = (bias.kind, bias.sinks, bias.rounding, bias.spec.paper_slopes)  # what kernel_refusal reads of it
    return tuple(k.name for k in KERNELS if k.runs and refusal(k, *form) is None)


def model_bias(model: nn.Module) -> AlibiBias:
    """The first self-attention's :class:`~hf_alibi.core.bias.AlibiBias` of a patched native ``model`` (every layer's
    has the same form, sinks, rounding and slopes)."""
    return next(m for m in model.modules() if isinstance(m, AlibiBias))


def what_runs(model: PreTrainedModel) -> str:
    """What a patched native ``model`` runs with (:func:`rendering_backends` of its row and its bias: Falcon's
    rounded bias, no flash kernel; MPT's own slopes, no cuDNN), as the end of
    :func:`~hf_alibi.core.names.check_backend`'s refusal."""
    backends = rendering_backends(model._native_row, model_bias(model))
    return (
        f"this {model._native_row.model_type} model (trained with ALiBi, run on hf_alibi's attention by patch_model) "
        f"runs with attn_implementation {', '.join(repr(name) for name in backends)}"
    )


def without_paged_cache(kwargs: dict) -> dict:
    """A continuous-batching forward's arguments as transformers' own forward of a native row can take them: no
    cache (it would ask the paged cache for a length it has not), no per-layer mask (the attention makes its own) and
    none of the layers' arguments (their :class:`~hf_alibi.core.batching.PagedBatch`, recorded for this forward,
    holds them). Each self-attention writes its keys and values to the paged cache itself."""
    dropped = {"cache", "past_key_values", "attention_mask", "is_causal", *LAYER_ARGUMENTS}
    return {**{k: v for k, v in kwargs.items() if k not in dropped}, "use_cache": False}
