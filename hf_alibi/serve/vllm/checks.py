"""vLLM's per-architecture config hooks (``MODELS_CONFIG_MAP``, :mod:`hf_alibi.serve.vllm.internals`), run while vLLM
reads the config, before any layer is built or weight loaded:

- :class:`AlibiConfig`, for each converted architecture: the refusals of :func:`hf_alibi.serve.vllm.refusal`, the
  length, and the attention backend pinned to one that applies the slopes on this platform
  (:func:`internals.pin_backend`);
- :func:`native_hook`, for vLLM's own ALiBi models (BLOOM, Falcon-RW): the same pin, wrapped around vLLM's own hook
  for that architecture if it has one;
- :func:`transformers_backend_hook`, for vLLM's Transformers backend classes (what ``model_impl="transformers"``
  resolves to): a converted config refused in one line that says what runs it, before an engine process starts.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from ...core.config import NO_MAXIMUM
from ...core.names import is_alibi
from .internals import TRANSFORMERS_IMPL, pin_backend, platform_name, transformers_impl_refusal
from .support import DEFAULT_MAX_MODEL_LEN, check

logger = logging.getLogger("hf_alibi.serve.vllm")


def pin(vllm_config, model: str) -> None:
    """:func:`internals.pin_backend` on this process's platform, said in one log line."""
    backend = pin_backend(vllm_config, platform_name(current_platform), AttentionBackendEnum)
    logger.info("hf_alibi: %s runs on attention backend %s (it applies the ALiBi slopes).", model, backend)


class AlibiConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``) of a converted architecture."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        check(model_config.hf_config)
        if model_config.model_impl == TRANSFORMERS_IMPL:  # where vLLM kept the converted name all the same
            raise ValueError(transformers_impl_refusal(model_config.architecture))
        if model_config.max_model_len >= NO_MAXIMUM:  # the marker's "no maximum", not a length the user gave
            model_config.max_model_len = DEFAULT_MAX_MODEL_LEN

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check(vllm_config.model_config.hf_config)
        pin(vllm_config, vllm_config.model_config.architecture)


def _uses_alibi(architecture: str, hf_config) -> bool:
    # BLOOM always; Falcon only as Falcon-RW (config.alibi), its rotary variants are left alone
    return architecture != "FalconForCausalLM" or bool(getattr(hf_config, "alibi", False))


def native_hook(architecture: str, previous: type[VerifyAndUpdateConfig] | None) -> type[VerifyAndUpdateConfig]:
    """The config hook of vLLM's own ALiBi class ``architecture``: ``previous`` (vLLM's own hook, if any) first, then
    the backend pinned as for a converted model."""
    base = previous or VerifyAndUpdateConfig

    class NativeAlibiConfig(base):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            base.verify_and_update_config(vllm_config)
            if _uses_alibi(architecture, vllm_config.model_config.hf_config):
                pin(vllm_config, architecture)

    NativeAlibiConfig.hf_alibi_wraps = previous  # what register() found there: registering twice wraps once
    return NativeAlibiConfig


def transformers_backend_hook(
    architecture: str, previous: type[VerifyAndUpdateConfig] | None
) -> type[VerifyAndUpdateConfig]:
    """The config hook of vLLM's Transformers backend class ``architecture``: a converted config refused in one line,
    then ``previous`` (vLLM's own hook for that name, if any) for every other model."""
    base = previous or VerifyAndUpdateConfig

    class TransformersBackendConfig(base):
        @staticmethod
        def verify_and_update_model_config(model_config) -> None:
            if is_alibi(model_config.hf_config):
                name = (getattr(model_config.hf_config, "architectures", None) or [architecture])[0]
                raise ValueError(transformers_impl_refusal(name))
            base.verify_and_update_model_config(model_config)

    TransformersBackendConfig.hf_alibi_wraps = previous
    return TransformersBackendConfig
