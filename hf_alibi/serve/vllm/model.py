"""A converted causal language model on vLLM's Transformers backend, with vLLM's ALiBi kernels.

vLLM's Transformers backend builds the transformers model from its config (here the converted ``Alibi<X>Model``:
its rotary answers the identity rotation, its layers carry their :class:`~hf_alibi.core.bias.AlibiBias`), sets the
attention implementation to ``"vllm"`` and makes one vLLM ``Attention`` per layer. This subclass changes two things:
the config may answer ``"vllm"`` (granted to this config alone, ``names.grant_engine``: the model's own forward then
leaves the batch to vLLM), and each layer's ``Attention`` gets that layer's slopes as ``alibi_slopes``, the slice of
this tensor-parallel rank's heads.
"""

from __future__ import annotations

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers import TransformersForCausalLM
from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR
from vllm.model_executor.models.transformers.fusers.attention import VLLM_ATTN_IMPL
from vllm.platforms import current_platform

from ...core.compat import assign_attn_implementation
from ...core.names import grant_engine
from ...core.slopes import CAUSAL
from .internals import layer_backends, layer_refusal, platform_name
from .sinks import SinkFold, fold, padded_head_size, unfold
from .support import check, rank_slopes

SINKS_ATTN_IMPL = "hf_alibi_vllm_sinks"  # the attention function of a converted model with sinks, in vLLM


class AlibiForCausalLM(TransformersForCausalLM):
    """vLLM's ``TransformersForCausalLM`` for a converted checkpoint: each layer's attention with its slopes, and
    each layer's backend checked once the model is built (before any weight loads, so before the first request)."""

    def __init__(self, *, vllm_config, prefix: str = ""):  # the signature vLLM inspects to call a model class
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        reason = layer_refusal(layer_backends(self, Attention), platform_name(current_platform))
        if reason is not None:
            raise ValueError(reason)
        if any(getattr(m, "hf_alibi_sink_fold", None) is not None for m in self.modules()):
            # built (vLLM's fusers accept only its own name while building): now each layer calls the fold first
            grant_engine(self.text_config, SINKS_ATTN_IMPL)
            assign_attn_implementation(self.text_config, SINKS_ATTN_IMPL)

    def _patch_config(self):
        check(self.config)  # again here: the engine process may be reached without the config hook
        grant_engine(self.text_config, VLLM_ATTN_IMPL)
        super()._patch_config()

    def _get_attn_cls(self):
        attention = super()._get_attn_cls()
        if attention is not Attention:  # an encoder's or MLA attention: no ALiBi slopes there
            raise ValueError(f"hf_alibi: vLLM would run this model with {attention.__name__}, which takes no slopes.")
        return self._attention_with_slopes

    def _attention_with_slopes(self, *, prefix: str, num_heads: int, **kwargs) -> Attention:
        # called once per layer by _create_attention_instances, ``prefix`` ending in "<module>.attn"
        module_name = prefix.removesuffix("." + VLLM_ATTN_ATTR)
        module = next(
            (self.get_submodule(name) for name, _ in self.attention_fusers.values() if module_name.endswith(name)),
            None,
        )
        alibi = getattr(module, "alibi", None)
        if alibi is None or alibi.kind != CAUSAL or alibi.rounding is not None:
            raise ValueError(f"hf_alibi: layer {module_name} has no causal ALiBi bias that vLLM can place.")
        slopes = rank_slopes(alibi.slope_values, num_heads, get_tensor_model_parallel_rank())
        if alibi.sinks:  # the exemption as extra q / k channels (sinks.py): vLLM's Attention at the padded head size
            head_size = kwargs["head_size"]
            padded = padded_head_size(head_size, self.model_config.dtype)
            module.hf_alibi_sink_fold = SinkFold(tuple(slopes), alibi.sinks, kwargs["scale"], head_size, padded)
            kwargs["head_size"] = padded
        return Attention(prefix=prefix, num_heads=num_heads, alibi_slopes=slopes, **kwargs)


def sinks_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """vLLM's attention function (``VLLM_ATTN_IMPL``) with the sinks' fold around it: the channels added to this
    layer's heads from each token's position (transformers' ``position_ids``, the positions vLLM hands the model),
    the padded columns dropped from the output."""
    spec = module.hf_alibi_sink_fold
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(
            f"hf_alibi: {type(module).__name__} does not hand position_ids to its attention function, which the "
            "sinks' fold needs: serve this model in transformers (hf-alibi serve)."
        )
    query, key, value = fold(spec, query, key, value, positions)
    output, weights = ALL_ATTENTION_FUNCTIONS[VLLM_ATTN_IMPL](module, query, key, value, attention_mask, **kwargs)
    return unfold(spec, output), weights


ALL_ATTENTION_FUNCTIONS.register(SINKS_ATTN_IMPL, sinks_attention_forward)  # a name of its own: nothing replaced
