"""vLLM's per-architecture config hook for the converted architectures (``MODELS_CONFIG_MAP``): the refusals of
:func:`hf_alibi.vllm.refusal` and the length, while vLLM reads the config (before any weight loads)."""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from ..core.config import NO_MAXIMUM
from .support import DEFAULT_MAX_MODEL_LEN, check


class AlibiConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``), run in the process that reads the config."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        check(model_config.hf_config)
        if model_config.max_model_len >= NO_MAXIMUM:  # the marker's "no maximum", not a length the user gave
            model_config.max_model_len = DEFAULT_MAX_MODEL_LEN
