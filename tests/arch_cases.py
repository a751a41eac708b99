"""The architectures the parametrized suite runs over: tiny configs, inputs and references.

One ``Case`` per configuration; several may share a model type (GPT-NeoX with parallel and with
sequential residuals). ``test_architectures.py`` checks that the model types here are exactly
``hf_alibi.supported_model_types()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from reference import (
    bert_reference_logits,
    gpt2_reference_logits,
    gpt_neox_reference_logits,
    opt_reference_logits,
    rotary_reference_logits,
    t5_reference_logits,
)
from tiny import VOCAB, random_ids, tiny_gpt2
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from hf_alibi.core.slopes import ENCODER_VARIANTS

MAX_LEN = 16  # every tiny config's original maximum length (T5: relative_attention_max_distance)


@dataclass(frozen=True)
class Case:
    name: str
    model_type: str
    kind: str  # "decoder", "encoder" or "seq2seq"
    make: Callable[..., transformers.PreTrainedModel]  # make(attn_implementation=...) -> original model, eval
    auto_class: str
    plain_class: str  # the transformers class that must refuse the checkpoint
    removed_fields: tuple[str, ...]
    takes_position_ids: bool = True
    # False: the case runs the reference-checked numerical suite (test_architectures.py, errors, weights)
    # but not the expensive persistence, remote-code, CLI and training files (FULL_CASES).
    full: bool = True

    @property
    def bidirectional(self) -> bool:
        return self.kind != "decoder"

    @property
    def variants(self) -> tuple[str | None, ...]:
        return ENCODER_VARIANTS if self.bidirectional else (None,)

    def inputs(self, batch: int, length: int, seed: int = 1) -> dict[str, torch.Tensor]:
        ids = random_ids(batch, length, seed=seed)
        if self.kind == "seq2seq":  # a target of its own length, past the original maximum too
            return {"input_ids": ids, "decoder_input_ids": random_ids(batch, length - 3, seed=seed + 100)}
        return {"input_ids": ids}

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends transformers allows this architecture (Gemma 2 soft-caps: no sdpa)."""
        return ROTARY_BACKENDS.get(self.model_type, ("eager", "sdpa"))

    def reference(self, model, inputs: dict, variant: str | None, attention_mask=None) -> torch.Tensor:
        if self.model_type == "gpt2":
            return gpt2_reference_logits(model, inputs["input_ids"])
        if self.model_type == "opt":
            return opt_reference_logits(self.make, model, inputs["input_ids"], attention_mask)
        if self.model_type == "gpt_neox":
            return gpt_neox_reference_logits(model, inputs["input_ids"])
        if self.model_type in ("bert", "roberta"):
            return bert_reference_logits(model, inputs["input_ids"], variant, attention_mask)
        if self.model_type == "t5":
            return t5_reference_logits(
                model, inputs["input_ids"], inputs["decoder_input_ids"], variant, attention_mask
            )
        if self.kind == "decoder":  # the rotary decoders
            return rotary_reference_logits(self.make, model, inputs["input_ids"], attention_mask)
        raise AssertionError(f"no reference for {self.model_type}")


def _seeded(cls, config_cls, default_backend: str = "sdpa", **values):
    def make(seed: int = 0, attn_implementation: str = default_backend, **overrides):
        torch.manual_seed(seed)
        config = config_cls(**{**values, **overrides}, attn_implementation=attn_implementation)
        return cls(config).eval()

    return make


def _make_gpt2(seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    return tiny_gpt2(seed=seed, attn_implementation=attn_implementation, **overrides)


_NEOX = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=MAX_LEN, bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
_BERT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=MAX_LEN, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
_OPT = dict(
    vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
    max_position_embeddings=MAX_LEN, dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=2,
    eos_token_id=2,
)  # fmt: skip
_ROBERTA = {**_BERT, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
_T5 = dict(
    vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=MAX_LEN, dropout_rate=0.0,
    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip

CASES = [
    Case("gpt2", "gpt2", "decoder", _make_gpt2, "AutoModelForCausalLM", "GPT2LMHeadModel", ("n_positions",)),
    Case(
        "gpt_neox",  # parallel residual, partial rotary (a quarter of each head rotated)
        "gpt_neox",
        "decoder",
        _seeded(
            transformers.GPTNeoXForCausalLM,
            transformers.GPTNeoXConfig,
            **_NEOX,
            rotary_pct=0.25,
            use_parallel_residual=True,
        ),
        "AutoModelForCausalLM",
        "GPTNeoXForCausalLM",
        ("max_position_embeddings",),
    ),
    Case(
        "gpt_neox_sequential",  # sequential residual, full rotary
        "gpt_neox",
        "decoder",
        _seeded(
            transformers.GPTNeoXForCausalLM,
            transformers.GPTNeoXConfig,
            **_NEOX,
            rotary_pct=1.0,
            use_parallel_residual=False,
        ),
        "AutoModelForCausalLM",
        "GPTNeoXForCausalLM",
        ("max_position_embeddings",),
    ),
    Case(
        "opt",  # learned positions with an offset of 2 (decoder.embed_positions)
        "opt",
        "decoder",
        _seeded(transformers.OPTForCausalLM, transformers.OPTConfig, **_OPT),
        "AutoModelForCausalLM",
        "OPTForCausalLM",
        ("max_position_embeddings",),
    ),
    Case(
        "bert",
        "bert",
        "encoder",
        _seeded(transformers.BertForMaskedLM, transformers.BertConfig, **_BERT),
        "AutoModelForMaskedLM",
        "BertForMaskedLM",
        ("max_position_embeddings",),
    ),
    Case(
        "roberta",
        "roberta",
        "encoder",
        _seeded(transformers.RobertaForMaskedLM, transformers.RobertaConfig, **_ROBERTA),
        "AutoModelForMaskedLM",
        "RobertaForMaskedLM",
        ("max_position_embeddings",),
    ),
    Case(
        "t5",
        "t5",
        "seq2seq",
        _seeded(transformers.T5ForConditionalGeneration, transformers.T5Config, **_T5),
        "AutoModelForSeq2SeqLM",
        "T5ForConditionalGeneration",
        ("relative_attention_num_buckets", "relative_attention_max_distance"),
        takes_position_ids=False,
    ),
]
# The rotary decoders: one tiny config each (2 layers, 4 query heads of 8, 2 KV heads: grouped-query
# attention everywhere), with what the family adds to attention switched on where the config has it.
_ROTARY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_LEN, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, attention_dropout=0.0,
)  # fmt: skip
_SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
ROTARY_EXTRAS = {
    "cohere": dict(logit_scale=1.0),
    "gemma": {},
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=50.0),  # soft-capping: eager / flex only
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    "llama": {},
    "mistral": dict(sliding_window=8),
    "olmo": {},
    "olmo2": {},
    "phi3": dict(partial_rotary_factor=0.5),
    "qwen2": dict(sliding_window=8, use_sliding_window=True, max_window_layers=1),
    "qwen3": {},
    "stablelm": dict(partial_rotary_factor=0.25, use_qk_layernorm=True),
    "starcoder2": dict(sliding_window=8, residual_dropout=0.0, embedding_dropout=0.0),
    # the second batch of rotary decoders (probed from outside first: eager and sdpa within 2e-7 of the reference)
    "apertus": dict(
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8,
        )
    ),
    "arcee": {},
    "cohere2": dict(**_SLIDING, logit_scale=1.0),
    "ernie4_5": {},
    "exaone4": dict(**_SLIDING),
    "glm": {},  # partial rotary (half of each head) by default, as glm4 and nemotron
    "glm4": {},
    "granitemoe": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_multiplier=0.2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    ),
    "hunyuan_v1_dense": {},
    "ministral": dict(**_SLIDING),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "nemotron": {},
    "olmo3": dict(**_SLIDING),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "persimmon": dict(partial_rotary_factor=0.5),
    "phi": dict(partial_rotary_factor=0.5, qk_layernorm=True),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "seed_oss": {},
    "smollm3": dict(no_rope_layer_interval=2),  # layer 2 has no rotary in the original either (NoPE)
}
# Rows whose cases run the reduced suite (Case.full False): the numbers against the reference on every
# backend, cache, padding, errors and kept weights, but not persistence, remote code, CLI or training,
# which exercise no code of their own (the same rotary strategy and the same saving code as the full
# rows). The MoE rows stay full: transformers renames expert weights on load, a persistence risk.
REDUCED = frozenset(
    {
        "apertus",
        "arcee",
        "ernie4_5",
        "exaone4",
        "glm",
        "glm4",
        "hunyuan_v1_dense",
        "ministral",
        "nemotron",
        "persimmon",
        "qwen3_moe",
        "seed_oss",
    }
)
# Backends transformers allows for the row's classes, in the order the tests use them.
ROTARY_BACKENDS = {"gemma2": ("eager", "flex_attention")}


def _rotary_case(model_type: str) -> Case:
    config_cls = transformers.CONFIG_MAPPING[model_type]
    model_cls = getattr(
        transformers, transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    )
    return Case(
        model_type, model_type, "decoder",
        _seeded(model_cls, config_cls, ROTARY_BACKENDS.get(model_type, ("sdpa",))[-1], **_ROTARY,
                **ROTARY_EXTRAS[model_type]),
        "AutoModelForCausalLM", model_cls.__name__, ("max_position_embeddings",), full=model_type not in REDUCED,
    )  # fmt: skip


CASES += [_rotary_case(model_type) for model_type in ROTARY_EXTRAS]
CASE_IDS = [case.name for case in CASES]
FULL_CASES = [case for case in CASES if case.full]
FULL_CASE_IDS = [case.name for case in FULL_CASES]
# (case, encoder variant) pairs: every variant for bidirectional cases, None for decoder-only ones.
VARIANT_PARAMS = [(case, variant) for case in CASES for variant in case.variants]
VARIANT_IDS = [f"{case.name}-{variant}" if variant else case.name for case, variant in VARIANT_PARAMS]
FULL_VARIANT_PARAMS = [(case, variant) for case, variant in VARIANT_PARAMS if case.full]
FULL_VARIANT_IDS = [name for name, (case, _) in zip(VARIANT_IDS, VARIANT_PARAMS) if case.full]


# The models trained with ALiBi (hf_alibi.native_model_types(): run, not converted), for
# tests/architectures/test_native_alibi.py; MPT's max_seq_len is MAX_LEN.
@dataclass(frozen=True)
class NativeCase:
    name: str
    model_type: str
    config: dict

    def make(self, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
        config_cls = transformers.CONFIG_MAPPING[self.model_type]
        model_cls = getattr(
            transformers, transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type]
        )
        torch.manual_seed(seed)
        return model_cls(config_cls(**{**self.config, **overrides})).eval()

    def reference(self, model: transformers.PreTrainedModel, length: int) -> transformers.PreTrainedModel:
        """transformers' own model with ``model``'s weights (unpatched), able to run ``length`` tokens."""
        if self.model_type != "mpt":
            return model
        config = copy.deepcopy(model.config)
        config.max_seq_len = max(length, config.max_seq_len)  # MPT's own code builds its bias at this length
        reference = type(model)(config).eval()
        reference.load_state_dict(model.state_dict())
        bias_max = config.attn_config.alibi_bias_max
        if bias_max != 8:  # transformers drops the config's value (see the module docstring): give it back
            build = partial(build_mpt_alibi_tensor, alibi_bias_max=bias_max)
            reference.transformer.build_mpt_alibi_tensor = lambda heads, length, *a, device=None, **k: build(
                heads, length, device=device
            )
        return reference


_COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_BLOOM = dict(_COMMON, hidden_size=48, n_layer=2, hidden_dropout=0.0, attention_dropout=0.0)
_MPT = dict(_COMMON, d_model=48, n_layers=2, max_seq_len=MAX_LEN, emb_pdrop=0.0, resid_pdrop=0.0)
FALCON_RW = dict(
    _COMMON, hidden_size=48, num_hidden_layers=2, alibi=True, multi_query=False, new_decoder_architecture=False,
    parallel_attn=False, bias=True, hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
NATIVE_CASES = [
    NativeCase("bloom-4", "bloom", dict(_BLOOM, n_head=4, hidden_size=32)),
    NativeCase("bloom-6", "bloom", dict(_BLOOM, n_head=6)),
    NativeCase("mpt-6-max8", "mpt", dict(_MPT, n_heads=6, attn_config=dict(alibi=True, alibi_bias_max=8))),
    NativeCase("mpt-6-max4", "mpt", dict(_MPT, n_heads=6, attn_config=dict(alibi=True, alibi_bias_max=4))),
    NativeCase(
        "mpt-4-clip-scale",
        "mpt",
        dict(_MPT, n_heads=4, attn_config=dict(alibi=True, alibi_bias_max=8, clip_qkv=0.5, softmax_scale=0.3)),
    ),
    NativeCase("falcon-rw-4", "falcon", dict(FALCON_RW, num_attention_heads=4, hidden_size=32)),
    NativeCase("falcon-rw-6", "falcon", dict(FALCON_RW, num_attention_heads=6)),
    NativeCase(
        "falcon-rw-6-parallel", "falcon", dict(FALCON_RW, num_attention_heads=6, parallel_attn=True, bias=False)
    ),
]
