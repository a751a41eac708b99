"""What vLLM can carry of a converted model, checked while vLLM reads its config (before any weight loads).

vLLM's attention takes one slope per head and adds ``slope * (key_position - query_position)`` to each causal score
(``alibi_slopes``; its CPU and GPU kernels alike): the paper's bias, with slopes as converted (the paper's, scaled,
given, or fitted per layer and head). What hf_alibi renders beyond that has no place there and is refused in one
line: sinks (the pretrained preset's bias-exempt first keys), an encoder's bidirectional bias, soft-capped scores
(where the bias goes relative to the cap is the kernel's, unchecked), and any task other than causal language
modelling. A model trained with ALiBi (BLOOM, MPT, Falcon-RW) is vLLM's own class and never reaches this.
"""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from ..core.config import NO_MAXIMUM
from ..core.names import is_alibi

# vLLM's own default for a model whose config states no length (config/model.py, _get_and_verify_max_len)
DEFAULT_MAX_MODEL_LEN = 2048
SERVED = "vLLM serves converted causal language models (Alibi<Model>ForCausalLM)"


def refusal(config) -> str | None:
    """Why vLLM cannot serve the converted model of ``config`` (a converted ``PretrainedConfig``), in one line, or
    None where it can."""
    if not is_alibi(config):
        return f"{type(config).__name__} is not a converted ALiBi config: {SERVED}."
    alibi = config.alibi
    name = (getattr(config, "architectures", None) or ["?"])[0]
    if alibi.get("encoder_variant") is not None or not str(name).endswith("ForCausalLM"):
        return f"{name} is not a causal language model: {SERVED}; run it in transformers."
    if alibi.get("sinks"):
        return (
            f"{name} was converted with sinks={alibi['sinks']} (its first keys carry no distance penalty), which "
            "vLLM's alibi_slopes cannot place: run it in transformers (`hf-alibi serve`), or convert it with "
            "--sinks 0 for vLLM."
        )
    if getattr(config, "attn_logit_softcapping", None):
        return (
            f"{name} soft-caps its attention scores, and where vLLM's kernels add the ALiBi bias relative to the cap "
            "is unchecked: run it in transformers (`hf-alibi serve`)."
        )
    return None


def check(config) -> None:
    """:func:`refusal` as a one-line ``ValueError``."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(f"hf_alibi: {reason}")


class AlibiConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``), run in the process that reads the config."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        check(model_config.hf_config)
        if model_config.max_model_len >= NO_MAXIMUM:  # the marker's "no maximum", not a length the user gave
            model_config.max_model_len = DEFAULT_MAX_MODEL_LEN
