"""Export converted models to GGUF, the file llama.cpp (llama-cli, llama-server, and what is built on it) runs.

llama.cpp runs ALiBi in architectures of its own; two of them take a converted model exactly:

* ``refact``: a Llama block (RMSNorm, SwiGLU, separate q/k/v with optional biases, grouped-query attention) with
  ALiBi and no rotary; its slopes are the paper's (max bias 8). The converted rotary rows whose block is Llama's
  once the rotary is gone map onto it: ``llama``, ``mistral`` and ``qwen2`` (no sliding window), ``smollm3``,
  ``seed_oss``, ``ernie4_5``, and ``phi3`` and ``glm`` (fused qkv / gate-up projections split). It has no o_proj
  or MLP biases.
* ``mpt``: a GPT-2 block (LayerNorm and linear biases, fused qkv, tanh GELU) with ALiBi
  (``mpt.attention.max_alibi_bias`` 8: the paper's slopes). Converted ``gpt2`` maps onto it (Conv1D weights
  transposed). llama.cpp's CPU GELU reads an fp16 table: logits differ from transformers' by ~1e-4 there.

Neither can express what a conversion for a pretrained checkpoint keeps (sinks, scaled, fitted or explicit
slopes, retained rotary frequencies or tables, a learned table's mean), nor the other rows' extras (q/k norms,
soft-capping, sliding windows, parallel residuals, embedding or logit scaling, biases refact drops, encoders):
those are refused before anything is written, in one line. The tokenizer goes in as llama.cpp's own converter
writes a byte-level BPE one (``tokenizer.ggml.model = "gpt2"``, tokens, types, merges, the pre-tokenizer's
name, special tokens, chat template), so llama.cpp needs nothing of hf_alibi.

>>> hf_alibi.export_gguf("my-alibi-model", "model.gguf", outtype="f16")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.settings import conversion_options
from ..hub.checkpoints import is_alibi, open_source

# Module level imports only what the command line's parser needs (OUTTYPES): torch, numpy and the config classes are
# imported where they are used, so that `hf-alibi export-gguf --help` and its argument errors answer at once.
if TYPE_CHECKING:
    import torch

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# each checked against llama.cpp itself (tests/export/test_gguf.py); the others differ in their block (norms with an
# offset or bias, scaled embeddings or residuals, q/k norms, non-gated MLPs, mixtures of experts, soft-capping)
REFACT_TYPES = ("llama", "mistral", "qwen2", "smollm3", "seed_oss", "ernie4_5", "phi3", "glm")
MPT_TYPES = ("gpt2",)
LLAMA_CPP_NATIVE = ("bloom", "mpt")  # the models trained with ALiBi that llama.cpp's own converter takes
MAX_ALIBI_BIAS = 8.0  # the paper's slopes: m_h = 2^(-8 h / n) (llama.cpp's m0/m1 rule for other head counts)
WHAT_EXPORTS = (
    f"GGUF export takes converted {', '.join(REFACT_TYPES)} models without sliding windows (llama.cpp's refact) and "
    f"{', '.join(MPT_TYPES)} (mpt), converted with the paper's slopes on every key (patch_model's defaults: no "
    "preset, sinks, slope_scale, slopes or retained positions)"
)


class GGUFExportError(ValueError):
    """What cannot be written as GGUF, in one line."""


def export_gguf(src, out: str | os.PathLike, outtype: str = "f32", tokenizer=None, overwrite: bool = False) -> Path:
    """Write the converted model ``src`` (a model object, or a converted folder or Hub id with its tokenizer) as GGUF.

    ``outtype``: ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the matrices (norms and biases stay f32, as llama.cpp's
    converter writes them). ``tokenizer`` is needed when ``src`` is a model object. Refused before anything is
    written when llama.cpp cannot run the model exactly (:data:`WHAT_EXPORTS`); ``out`` appears whole or not at all,
    and an existing ``out`` is replaced only with ``overwrite=True``.

    >>> export_gguf(model, "model.gguf", tokenizer=tokenizer)  # doctest: +SKIP
    """
    import gguf

    if outtype not in OUTTYPES:
        raise GGUFExportError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}.")
    out = check_output_file(out, overwrite)
    model, tokenizer = _load(src, tokenizer)
    arch = check_exportable(model)
    vocab = _vocab(tokenizer, model.config.vocab_size)  # refuses an unknown tokenizer before writing
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    try:
        writer = gguf.GGUFWriter(staging, arch)
        _write_parameters(writer, model, arch, outtype)
        _write_vocab(writer, gguf, vocab)
        from ..core.partitions import whole_weights  # torch: not at import (the CLI's parser imports this module)

        # until the tensors are written: a ZeRO-3 partition gathered; a DTensor or meta weight refused
        with whole_weights(model, "export_gguf"):
            for name, tensor in _tensors(model, arch):
                _add_tensor(writer, gguf, name, tensor, outtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        os.replace(staging, out)
    finally:
        staging.unlink(missing_ok=True)
    return out


def check_output_file(out: str | os.PathLike, overwrite: bool) -> Path:
    """``out`` as a path, or a one-line :class:`GGUFExportError` where it is a folder, or exists without
    ``overwrite`` (export_gguf's check, asked by the command line before the library loads too)."""
    out = Path(out)
    if out.is_dir():
        raise GGUFExportError(f"{out} is a folder: give the path of the .gguf file to write.")
    if out.exists() and not overwrite:
        raise GGUFExportError(f"{out} exists: pass overwrite=True (hf-alibi export-gguf --overwrite) to replace it.")
    return out


def _load(src, tokenizer):
    from transformers import PreTrainedModel

    if isinstance(src, PreTrainedModel):
        if tokenizer is None:
            raise GGUFExportError("export_gguf(model, ...) needs tokenizer=: GGUF carries the tokenizer.")
        return src, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(src)
    source = open_source(folder)
    config = source.config
    _refuse_native(config["model_type"], config)
    if not is_alibi(config):
        raise GGUFExportError(f"{folder} is not an ALiBi checkpoint: convert it first (hf-alibi convert).")
    if tokenizer is None:  # before the weights load: GGUF carries the tokenizer, and a folder may lack one
        if source.has_tokenizer() is False:
            raise GGUFExportError(
                f"{folder} has no tokenizer files, and GGUF carries the tokenizer: save it there first "
                f"(tokenizer.save_pretrained({str(folder)!r})), then export again."
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as error:
            raise GGUFExportError(f"{folder} has no tokenizer llama.cpp could use: {error}".splitlines()[0]) from None
    return AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer


def check_exportable(model) -> str:
    """The llama.cpp architecture ``model`` runs as exactly (``"refact"`` or ``"mpt"``), else a one-line error."""
    from ..core.config import get_settings

    config = model.config
    _refuse_native(config.model_type, config)
    if not is_alibi(config):
        raise GGUFExportError("This model is not converted to ALiBi: hf_alibi.patch_model it first.")
    settings = get_settings(config)
    base = settings.base_model_type
    # every declared option away from its default (the paper's ALiBi): llama.cpp has none of them, and an option
    # added later is refused here until someone shows llama.cpp can run it
    kept = [
        f"{field.name}={value}" if isinstance(value, (int, float)) else field.name
        for field in conversion_options()
        if (value := getattr(settings, field.name)) != field.default
    ]
    if kept:
        raise GGUFExportError(f"llama.cpp cannot express {', '.join(kept)} of this conversion. {WHAT_EXPORTS}.")
    if base in MPT_TYPES:
        _check_gpt2(config)
        return "mpt"
    if base not in REFACT_TYPES:
        raise GGUFExportError(f"llama.cpp has no ALiBi architecture for {base!r}. {WHAT_EXPORTS}.")
    _check_llama_like(model, base)
    return "refact"


def _refuse_native(model_type: str, config) -> None:
    # BLOOM, MPT, Falcon-RW trained with ALiBi stay in their original format (hf_alibi.native): llama.cpp's own
    # converter reads BLOOM and MPT folders as they are (its bloom and mpt architectures); its falcon is rotary only
    from ..convert.registry import get_native_architecture

    row = get_native_architecture(model_type)
    if row is None or not row.uses_alibi(config):
        return
    if model_type in LLAMA_CPP_NATIVE:
        where = "llama.cpp's converter reads its folder as it is (python convert_hf_to_gguf.py FOLDER, from llama.cpp)"
    else:
        where = f"llama.cpp has no {model_type} with ALiBi (its {model_type} architecture is rotary): no GGUF for it"
    raise GGUFExportError(
        f"This {model_type} model was trained with ALiBi and keeps transformers' own format: {where}. "
        "hf-alibi export-gguf writes the checkpoints hf_alibi converts."
    )


def _refuse(what: str) -> None:
    raise GGUFExportError(f"llama.cpp's refact/mpt cannot run {what}. {WHAT_EXPORTS}.")


def _check_gpt2(config) -> None:
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(f"activation {config.activation_function!r} (mpt's GELU is the tanh one)")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        _refuse("GPT-2's attention without the 1/sqrt(d) scale, or scaled by layer")
    if getattr(config, "add_cross_attention", False):
        _refuse("cross-attention")


def _check_llama_like(model, base: str) -> None:
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse(f"activation {config.hidden_act!r} (refact's MLP is SwiGLU)")
    import torch

    layer = model.base_model.layers[0]
    if any(module.bias is not None for module in layer.mlp.modules() if isinstance(module, torch.nn.Linear)):
        _refuse("MLP biases (refact loads none)")
    attention = layer.self_attn
    if attention.o_proj.bias is not None:
        _refuse("an o_proj bias (refact loads none)")
    if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
        _refuse("q/k norms")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    if sliding or any(kind != "full_attention" for kind in layer_types):
        _refuse("sliding-window attention")
    if abs(attention.scaling - attention.head_dim**-0.5) > 1e-12:
        _refuse("an attention scale other than 1/sqrt(head_dim)")


def _write_parameters(writer, model, arch: str, outtype: str) -> None:
    import gguf

    config = model.config
    writer.add_context_length(2**20)  # ALiBi has no trained maximum: llama.cpp sizes its context by n_ctx
    if arch == "mpt":
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_max_alibi_bias(MAX_ALIBI_BIAS)
    else:
        attention = model.base_model.layers[0].self_attn
        heads = config.num_attention_heads
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(_kv_heads(config))
        writer.add_key_length(attention.head_dim)
        writer.add_value_length(attention.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_file_type(file_types[outtype])


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # grouped, else every head


def _tensors(model, arch: str):
    """``(gguf name, float32 tensor)`` in llama.cpp's layout (``(out, in)`` for matrices)."""
    state = {name: t.detach().float() for name, t in model.state_dict().items()}
    prefix = model.base_model_prefix + "."
    base = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
    if arch == "mpt":
        yield "token_embd.weight", base["wte.weight"]
        for i in range(model.config.n_layer):
            h = f"h.{i}."
            yield from (
                (f"blk.{i}.attn_norm.weight", base[h + "ln_1.weight"]),
                (f"blk.{i}.attn_norm.bias", base[h + "ln_1.bias"]),
                (f"blk.{i}.attn_qkv.weight", base[h + "attn.c_attn.weight"].T),  # Conv1D is (in, out)
                (f"blk.{i}.attn_qkv.bias", base[h + "attn.c_attn.bias"]),
                (f"blk.{i}.attn_output.weight", base[h + "attn.c_proj.weight"].T),
                (f"blk.{i}.attn_output.bias", base[h + "attn.c_proj.bias"]),
                (f"blk.{i}.ffn_norm.weight", base[h + "ln_2.weight"]),
                (f"blk.{i}.ffn_norm.bias", base[h + "ln_2.bias"]),
                (f"blk.{i}.ffn_up.weight", base[h + "mlp.c_fc.weight"].T),
                (f"blk.{i}.ffn_up.bias", base[h + "mlp.c_fc.bias"]),
                (f"blk.{i}.ffn_down.weight", base[h + "mlp.c_proj.weight"].T),
                (f"blk.{i}.ffn_down.bias", base[h + "mlp.c_proj.bias"]),
            )
        yield "output_norm.weight", base["ln_f.weight"]
        yield "output_norm.bias", base["ln_f.bias"]
    else:
        yield "token_embd.weight", base["embed_tokens.weight"]
        attention = model.base_model.layers[0].self_attn
        config = model.config
        q = config.num_attention_heads * attention.head_dim
        kv = _kv_heads(config) * attention.head_dim
        for i in range(config.num_hidden_layers):
            layer = {name[len(f"layers.{i}.") :]: t for name, t in base.items() if name.startswith(f"layers.{i}.")}
            for kind in ("weight", "bias"):  # phi3's fused q/k/v: [q; k; v] along the output rows
                fused = layer.pop(f"self_attn.qkv_proj.{kind}", None)
                if fused is not None:
                    for part, tensor in zip("qkv", fused.split([q, kv, kv])):
                        layer[f"self_attn.{part}_proj.{kind}"] = tensor
            fused = layer.pop("mlp.gate_up_proj.weight", None)  # phi3, glm: gate, up = chunk(2) of the output
            if fused is not None:
                layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"] = fused.chunk(2)
            for theirs, ours in REFACT_NAMES.items():
                if theirs in layer:
                    yield f"blk.{i}.{ours}", layer[theirs]
        yield "output_norm.weight", base["norm.weight"]
    output = model.get_output_embeddings().weight
    if output is not model.get_input_embeddings().weight:  # tied: llama.cpp reads token_embd for both
        yield "output.weight", output.detach().float()


REFACT_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _add_tensor(writer, gguf, name: str, tensor: torch.Tensor, outtype: str) -> None:
    import numpy as np

    # the weights may sit on a GPU (a model trained there, FSDP's gathered state): GGUF is written from host memory
    data = tensor.detach().cpu().float().contiguous().numpy()
    # vectors (norms, biases) stay f32, as llama.cpp's converter writes them
    if data.ndim < 2 or outtype == "f32":
        writer.add_tensor(name, data)
        return
    kind = {"f16": None, "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    if kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
        kind = None  # rows that are not whole Q8_0 blocks: f16, as llama.cpp's converter falls back
    if kind is None:
        writer.add_tensor(name, data.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)  # shape read from the bytes


def _vocab(tokenizer, vocab_size: int) -> dict:
    """Tokens, types, merges, pre-tokenizer name and special ids of a byte-level BPE tokenizer, as llama.cpp's
    converter reads them; a one-line error for any other kind."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError("GGUF export needs a fast (tokenizers) tokenizer: a byte-level BPE one.")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"GGUF export takes byte-level BPE tokenizers, not {model.get('type')!r}.")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise GGUFExportError(f"The tokenizer has ids up to {max(vocab.values())}, the model {vocab_size} rows.")
    by_id = {i: token for token, i in vocab.items()}
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append("UNUSED")
        elif token in added:
            tokens.append(token)
            types.append("CONTROL" if added[token].special else "USER_DEFINED")
        else:
            tokens.append(token)
            types.append("NORMAL")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else None
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("x", add_special_tokens=True)["input_ids"][:1] == [bos]
    return dict(
        tokens=tokens, types=types, merges=merges, pre=pre, template=template,
        bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id,
        unk=tokenizer.unk_token_id, adds_bos=adds_bos,
    )  # fmt: skip


def _pre_tokenizer_name(pre: dict | None) -> str:
    # llama.cpp names pre-tokenizers (by the hash of a test string's tokens, in its converter); GPT-2's byte-level
    # one is "gpt-2". Others would need their own name and regex in llama.cpp: refused rather than guessed.
    steps = pre.get("pretokenizers", [pre]) if pre else []
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"
    raise GGUFExportError(
        "GGUF export knows the GPT-2 byte-level pre-tokenizer only (llama.cpp names others by their regex): "
        f"this tokenizer's is {json.dumps(pre)[:80]}."
    )


def _write_vocab(writer, gguf, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types([getattr(gguf.TokenType, kind) for kind in vocab["types"]])
    writer.add_token_merges(vocab["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):  # fmt: skip
        if vocab[key] is not None:
            add(vocab[key])
    writer.add_add_bos_token(vocab["adds_bos"])  # as the tokenizer does (GPT-2's adds none)
    if vocab["template"]:
        writer.add_chat_template(vocab["template"])
