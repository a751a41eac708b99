"""vLLM serves the decoders hf_alibi converts, with vLLM's own ALiBi kernels (``pip install -e ".[vllm]"``).

vLLM loads this as a general plugin (entry point ``vllm.general_plugins``, :mod:`hf_alibi_boot.vllm`) in each of its
processes. :func:`register` names every converted architecture (``Alibi<Class>``) in vLLM's model registry:

- a converted causal language model (``Alibi<X>ForCausalLM``) runs as :class:`model.AlibiForCausalLM`, vLLM's
  Transformers backend with each layer's vLLM ``Attention`` handed that layer's slopes (``alibi_slopes``; each
  tensor-parallel rank its heads' slice). vLLM's kernels then place the bias in prefill, chunked prefill and decoding
  over its paged cache, prefix caching included. That class alone lets the model's config answer ``"vllm"``
  (:func:`hf_alibi.core.names.grant_engine`): reached any other way (``model_impl="transformers"``), a converted
  model is still refused, since vLLM's attention would then run without the bias;
- what vLLM's ``alibi_slopes`` cannot carry (:func:`refusal`) is refused in one line while vLLM reads the config,
  before any weight loads (:class:`checks.AlibiConfig`, vLLM's config hook). vLLM's attention adds
  ``slope * (key_position - query_position)`` to each causal score (its CPU and GPU kernels alike): the paper's bias,
  with slopes as converted (the paper's, scaled, given, or fitted per layer and head). Sinks (the pretrained preset's
  bias-exempt first keys) ride in extra query / key channels that give back what vLLM's bias took from those keys
  (:mod:`hf_alibi.serve.vllm.sinks`). What has no place there: an encoder's bidirectional bias, soft-capped scores
  (where the bias goes relative to the cap is the kernel's, unchecked), and any task other than causal language
  modelling;
- the length marker a converted config holds (no maximum) becomes vLLM's ``--max-model-len``, else its default for
  a model that states no length (:data:`DEFAULT_MAX_MODEL_LEN`).

Every architecture served here, and vLLM's own ALiBi classes (BLOOM, Falcon-RW: their config hooks, vLLM's own
kept), run on an attention backend that applies the slopes on the platform: pinned while vLLM reads the config where
none is named, refused in one line where the one named drops them, and each layer's checked once the model is built
(:mod:`hf_alibi.serve.vllm.internals`: every vLLM internal read, with the versions read on).
``model_impl="transformers"`` on a converted folder is refused while vLLM reads the config, in one line that says
what runs it.
"""

from __future__ import annotations

import logging

from .support import DEFAULT_MAX_MODEL_LEN, SERVED, check, converted_architectures, rank_slopes, refusal

__all__ = ["DEFAULT_MAX_MODEL_LEN", "SERVED", "check", "converted_architectures", "rank_slopes", "refusal", "register"]


logger = logging.getLogger("hf_alibi.serve.vllm")
_WARNED = False  # the version line, once per process


def register() -> None:
    """vLLM's general plugin (through :func:`hf_alibi_boot.vllm.register`): each converted architecture to
    :class:`model.AlibiForCausalLM`, with :class:`checks.AlibiConfig` as its config hook (refusals and the length).
    Idempotent: vLLM may call it more than once per process."""
    import vllm
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .checks import AlibiConfig, native_hook, transformers_backend_hook
    from .internals import NATIVE_ALIBI, TRANSFORMERS_BACKEND_CAUSAL, version_warning
    from .model import AlibiForCausalLM

    global _WARNED
    warning = version_warning(vllm.__version__)
    if warning is not None and not _WARNED:
        _WARNED = True
        logger.warning(warning)
    for name in converted_architectures():
        # the class itself, not "module:class": vLLM inspects a class named by string in a fresh interpreter, which
        # imports transformers' image code before any plugin could hide what cannot load (hf_alibi_boot.vllm)
        ModelRegistry.register_model(name, AlibiForCausalLM)
        MODELS_CONFIG_MAP[name] = AlibiConfig
    # vLLM's own hooks for these names (none in 0.32 / 0.33) are kept, wrapped; registering twice wraps once
    for names, hook in ((NATIVE_ALIBI, native_hook), (TRANSFORMERS_BACKEND_CAUSAL, transformers_backend_hook)):
        for name in names:
            previous = MODELS_CONFIG_MAP.get(name)
            MODELS_CONFIG_MAP[name] = hook(name, getattr(previous, "hf_alibi_wraps", previous))
