"""Independent references for the tests: explicit loops and hand-written attention.

Nothing here imports hf_alibi's math: the slopes follow fairseq's recursive ``get_slopes``, the bias
is built element by element, and attention is softmax(QK^T * scale + bias) V written out.
"""

from __future__ import annotations

import functools
import math

import torch

NEG = float("-inf")


def fairseq_slopes(n: int) -> list[float]:
    """fairseq's get_slopes (ofirpress/attention_with_linear_biases), verbatim in structure."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + fairseq_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def explicit_bias(kind: str, slopes: list[float], q_len: int, kv_len: int, right: list[float] | None = None):
    """(H, q, kv) float64 bias written with loops; masked entries are -inf."""
    n = len(slopes)
    out = torch.zeros(n, q_len, kv_len, dtype=torch.float64)
    offset = kv_len - q_len
    for h in range(n):
        for r in range(q_len):
            i = r + offset
            for j in range(kv_len):
                d = i - j
                if kind == "learned":
                    out[h, r, j] = slopes[h] * d if d >= 0 else right[h] * (-d)
                    continue
                value = -slopes[h] * abs(d)
                if kind == "causal" and j > i:
                    value = NEG
                if kind == "nonsymmetric" and ((h < n // 2 and j > i) or (h >= n // 2 and j < i)):
                    value = NEG
                out[h, r, j] = value
    return out


def reference_attention(q, k, v, bias, scaling, key_padding=None):
    """softmax(q k^T * scaling + bias) v in float64; q (B, H, q, D), bias (H, q, kv) or (B, H, q, kv).

    ``key_padding`` (B, kv) bool, True = real token: padded keys get -inf.
    """
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling + bias
    if key_padding is not None:
        scores = scores.masked_fill(~key_padding[:, None, None, :], NEG)
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.double())


def gpt2_reference_logits(model, input_ids: torch.Tensor, bias: torch.Tensor | None = None, key_padding=None):
    """Logits of a converted GPT-2 computed by hand: no wpe, attention with -m|i-j| (float64 attention).

    Uses the model's LayerNorms, projections and MLPs as plain functions; the attention and the
    absence of position embeddings are what is checked. ``bias``: one for every layer, or a list (per layer).
    """
    base = model.base_model
    n_head = model.config.n_head
    slopes = fairseq_slopes(n_head)
    hidden = base.wte(input_ids)
    batch, length, width = hidden.shape
    head_dim = width // n_head
    bias = explicit_bias("causal", slopes, length, length) if bias is None else bias
    for layer_idx, block in enumerate(base.h):
        layer_bias_ = bias[layer_idx] if isinstance(bias, (list, tuple)) else bias  # one per layer, or one for all
        attn = block.attn
        x = block.ln_1(hidden)
        q, k, v = attn.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        scaling = head_dim**-0.5 if model.config.scale_attn_weights else 1.0
        if model.config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer_idx + 1)
        out = torch.nan_to_num(reference_attention(q, k, v, layer_bias_, scaling, key_padding)).to(hidden.dtype)
        out = out.transpose(1, 2).reshape(batch, length, width)
        hidden = hidden + attn.c_proj(out)
        hidden = hidden + block.mlp(block.ln_2(hidden))
    hidden = base.ln_f(hidden)
    return model.lm_head(hidden)


# --- hand-written forwards of the other registered architectures ---------------
# Each uses the model's norms, projections and MLPs as plain functions and writes out the rest:
# the embeddings (no position table), the split into heads, the attention with the explicit bias
# of the layer's kind (float64) and the residual wiring. The kind comes from the caller, never
# from hf_alibi; learned slopes are read from the model's weights.


def layer_bias(kind: str, n_head: int, q_len: int, kv_len: int, alibi_module=None) -> torch.Tensor:
    """(H, q, kv) explicit bias; ``"none"`` is zeros (cross-attention), ``"learned"`` reads the layer's slopes."""
    if kind == "none":
        return torch.zeros(n_head, q_len, kv_len, dtype=torch.float64)
    if kind == "learned":
        left = (-torch.sigmoid(alibi_module.slopes_left.detach().double())).tolist()
        right = (-torch.sigmoid(alibi_module.slopes_right.detach().double())).tolist()
        return explicit_bias("learned", left, q_len, kv_len, right=right)
    return _fixed_bias(kind, n_head, q_len, kv_len).clone()


@functools.lru_cache(maxsize=64)
def _fixed_bias(kind: str, n_head: int, q_len: int, kv_len: int) -> torch.Tensor:
    return explicit_bias(kind, fairseq_slopes(n_head), q_len, kv_len)  # the loops are slow: built once


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    batch, length, width = x.shape
    return x.view(batch, length, n_head, width // n_head).transpose(1, 2)  # (B, H, L, D)


def _merge(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A padded query of a nonsymmetric head may see no key at all: NaN here. Its value never reaches
    # a real token, but 0 * NaN would in the next layer, so it is zeroed.
    out = torch.nan_to_num(out, nan=0.0)
    batch, n_head, length, head_dim = out.shape
    return out.to(dtype).transpose(1, 2).reshape(batch, length, n_head * head_dim)


def gpt_neox_reference_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """A converted GPT-NeoX by hand: no rotation of any dimension, causal -m(i-j), both residual forms."""
    base, config = model.base_model, model.config
    n_head = config.num_attention_heads
    hidden = base.embed_in(input_ids)
    batch, length, width = hidden.shape
    head_dim = width // n_head
    bias = layer_bias("causal", n_head, length, length)
    for layer in base.layers:
        attn = layer.attention
        qkv = attn.query_key_value(layer.input_layernorm(hidden)).view(batch, length, n_head, 3 * head_dim)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)  # NeoX interleaves q, k, v per head
        attn_out = attn.dense(_merge(reference_attention(q, k, v, bias, head_dim**-0.5), hidden.dtype))
        if config.use_parallel_residual:
            hidden = hidden + attn_out + layer.mlp(layer.post_attention_layernorm(hidden))
        else:
            hidden = hidden + attn_out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.get_output_embeddings()(base.final_layer_norm(hidden))


def bert_reference_logits(
    model, input_ids: torch.Tensor, kind: str, attention_mask=None, bias=None, positions=None
) -> torch.Tensor:
    """A converted BERT / RoBERTa masked LM by hand: word + token-type embeddings (+ ``positions``, a
    ``(B|1, L, width)`` tensor, where given), ``kind`` bias."""
    base = model.base_model
    n_head = model.config.num_attention_heads
    emb = base.embeddings
    inputs = emb.word_embeddings(input_ids) + emb.token_type_embeddings(torch.zeros_like(input_ids))
    hidden = emb.LayerNorm(inputs if positions is None else inputs + positions)
    length = input_ids.shape[1]
    padding = attention_mask.bool() if attention_mask is not None else None
    for layer in base.encoder.layer:
        attn = layer.attention.self
        q, k, v = (_heads(proj(hidden), n_head) for proj in (attn.query, attn.key, attn.value))
        this_bias = layer_bias(kind, n_head, length, length, getattr(attn, "alibi", None)) if bias is None else bias
        out = _merge(reference_attention(q, k, v, this_bias, q.shape[-1] ** -0.5, padding), hidden.dtype)
        attn_out = layer.attention.output(out, hidden)  # dense, then LayerNorm(x + residual)
        hidden = layer.output(layer.intermediate(attn_out), attn_out)
    head = model.cls if hasattr(model, "cls") else model.lm_head
    return head(hidden)


def _t5_attention(attn, x, memory, bias, padding=None):
    n_head = attn.n_heads
    q, k, v = _heads(attn.q(x), n_head), _heads(attn.k(memory), n_head), _heads(attn.v(memory), n_head)
    return attn.o(_merge(reference_attention(q, k, v, bias, 1.0, padding), x.dtype))  # T5: no 1/sqrt(d)


def t5_reference_logits(model, input_ids, decoder_input_ids, kind: str, attention_mask=None) -> torch.Tensor:
    """A converted T5ForConditionalGeneration by hand: encoder ``kind``, decoder causal, cross-attention none."""
    n_head = model.config.num_heads
    padding = attention_mask.bool() if attention_mask is not None else None
    src, tgt = input_ids.shape[1], decoder_input_ids.shape[1]
    hidden = model.shared(input_ids)
    for block in model.encoder.block:
        self_attn = block.layer[0]
        bias = layer_bias(kind, n_head, src, src, getattr(self_attn.SelfAttention, "alibi", None))
        x = self_attn.layer_norm(hidden)
        hidden = hidden + _t5_attention(self_attn.SelfAttention, x, x, bias, padding)
        hidden = block.layer[-1](hidden)  # T5LayerFF: x + FF(norm(x))
    memory = model.encoder.final_layer_norm(hidden)
    hidden = model.shared(decoder_input_ids)
    causal, cross = layer_bias("causal", n_head, tgt, tgt), layer_bias("none", n_head, tgt, src)
    for block in model.decoder.block:
        x = block.layer[0].layer_norm(hidden)
        hidden = hidden + _t5_attention(block.layer[0].SelfAttention, x, x, causal)
        x = block.layer[1].layer_norm(hidden)
        hidden = hidden + _t5_attention(block.layer[1].EncDecAttention, x, memory, cross, padding)
        hidden = block.layer[-1](hidden)
    hidden = model.decoder.final_layer_norm(hidden)
    if model.config.scale_decoder_outputs:
        hidden = hidden * model.config.d_model**-0.5
    return model.lm_head(hidden)


# --- the rotary decoders (Llama family): the original model, unrotated, with an explicit-bias attention --------
# Written without hf_alibi: the rotation is removed by zeroing the original rotary embedding's inverse
# frequencies (so cos = 1, sin = 0 at every position), and attention is a function registered here, through
# transformers' public attention interface, that adds the loop-built causal bias in float64 to transformers'
# own eager mask (causality, padding and sliding windows), after the model's soft-cap if it has one.

REFERENCE_ATTENTION = "hf_alibi_tests_reference"


def reference_alibi_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                              **kwargs):  # fmt: skip
    n_head, q_len, kv_len = query.shape[1], query.shape[2], key.shape[2]
    rep = n_head // key.shape[1]  # grouped KV heads: each serves `rep` consecutive query heads
    k, v = key.repeat_interleave(rep, dim=1).double(), value.repeat_interleave(rep, dim=1).double()
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.einsum("bhqd,bhkd->bhqk", query.double(), k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + _fixed_bias("causal", n_head, q_len, kv_len)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, :kv_len].double()
    out = torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype), None


def _register_reference_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(REFERENCE_ATTENTION, reference_alibi_attention)
    AttentionMaskInterface.register(REFERENCE_ATTENTION, eager_mask)


_register_reference_attention()


def opt_reference_logits(make_original, model, input_ids, attention_mask=None) -> torch.Tensor:
    """Logits of a converted OPT: the original architecture with a position table long enough for the input,
    zeroed (so it adds nothing at any position), the same weights and the reference attention above."""
    reference = make_original(attn_implementation=REFERENCE_ATTENTION, max_position_embeddings=input_ids.shape[1])
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and missing == ["model.decoder.embed_positions.weight"], (missing, unexpected)
    with torch.no_grad():
        reference.model.decoder.embed_positions.weight.zero_()
    return reference.eval()(input_ids=input_ids, attention_mask=attention_mask).logits


def rotary_reference_logits(make_original, model, input_ids, attention_mask=None) -> torch.Tensor:
    """Logits of a converted rotary decoder, computed by its original architecture with the same weights,
    the rotation zeroed and the reference attention above. ``make_original(attn_implementation=...)``
    builds the original model."""
    reference = make_original(attn_implementation=REFERENCE_ATTENTION)
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in name for name in missing), (missing, unexpected)
    for name, buffer in reference.named_buffers():
        if name.endswith("inv_freq"):
            buffer.zero_()
    reference = reference.to(torch.float32).eval()
    return reference(input_ids=input_ids, attention_mask=attention_mask).logits


# --- the options for pretrained checkpoints (sinks, retained rotary frequencies, scaled slopes) --------------


def first_real_tokens(attention_mask: torch.Tensor | None, batch: int) -> list[int]:
    """Where each row's real tokens start, by a loop over the 2D mask (0 without a mask)."""
    if attention_mask is None:
        return [0] * batch
    return [next(j for j, m in enumerate(row.tolist()) if m) for row in attention_mask]


def sink_bias(
    kind: str, slopes: list[float], length: int, sinks: int, starts: list[int], distance=None
) -> torch.Tensor:
    """(B, H, L, L) float64, written with loops: the ALiBi bias of ``kind`` (causal, symmetric or
    nonsymmetric) with the keys ``starts[b] <= j < starts[b] + sinks`` at 0 wherever they may be seen; ``distance``
    maps each |i - j| the penalty reads (default: as it is)."""
    n = len(slopes)
    out = torch.zeros(len(starts), n, length, length, dtype=torch.float64)
    for b, start in enumerate(starts):
        for h in range(n):
            for i in range(length):
                for j in range(length):
                    if (kind == "causal" and j > i) or (
                        kind == "nonsymmetric" and ((h < n // 2 and j > i) or (h >= n // 2 and j < i))
                    ):
                        out[b, h, i, j] = NEG
                    elif start <= j < start + sinks:
                        out[b, h, i, j] = 0.0
                    else:
                        d = abs(i - j)
                        out[b, h, i, j] = -slopes[h] * (d if distance is None else distance(d))
    return out


def _reference_softmax(scores, bias, attention_mask, v, dtype) -> torch.Tensor:
    # the references' float64 tail: the bias and transformers' eager mask added, softmax, values, (B, q, H, D) out
    scores = scores + bias
    if attention_mask is not None:
        scores = scores + attention_mask.double()
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return torch.einsum("bhqk,bhkd->bqhd", weights, v).to(dtype)


def _register_reference(name: str, attention) -> None:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)


def register_sink_reference(name: str, bias: torch.Tensor) -> None:
    """Register ``name`` as a reference attention adding ``bias`` ((B, H, L, L) float64, no cache) to
    transformers' eager mask (causality, padding), float64 softmax, grouped KV heads shared by hand."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(rep, dim=1).double(), value.repeat_interleave(rep, dim=1).double()
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.einsum("bhqd,bhkd->bhqk", query.double(), k) * scaling
        return _reference_softmax(scores, bias, attention_mask, v, query.dtype), None

    _register_reference(name, attention)


class KneeRotaryReference(torch.nn.Module):
    """A Llama-layout rotary module computing every angle in float64 with loops: dimension ``k`` of ``width`` has
    frequency ``theta^(-2k/width)``; none where its wavelength passes ``max_wavelength``; past position
    ``knee - 1``, those of wavelength > ``knee`` read position ``(knee - 1) + (p - knee + 1) / stretch``, and that
    position divided by ``interpolation`` (at every position)."""

    def __init__(
        self, width: int, theta: float, max_wavelength: float, knee: float, stretch: float, interpolation: float = 1.0
    ):
        super().__init__()
        self.width, self.theta, self.max_wavelength, self.knee = width, theta, max_wavelength, knee
        self.stretch, self.interpolation = stretch, interpolation

    def forward(self, x, position_ids):
        angles = torch.zeros(*position_ids.shape, self.width // 2, dtype=torch.float64)
        for k in range(self.width // 2):
            frequency = self.theta ** (-2 * k / self.width)
            wavelength = 2 * math.pi / frequency
            for b in range(position_ids.shape[0]):
                for i, p in enumerate(position_ids[b].tolist()):
                    if wavelength > self.max_wavelength:
                        continue
                    last = self.knee - 1
                    q = p if wavelength <= self.knee or p <= last else last + (p - last) / self.stretch
                    if wavelength > self.knee:
                        q = q / self.interpolation
                    angles[b, i, k] = frequency * q
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def register_window_reference(name: str, bias: torch.Tensor, window: int, stretch: float, frequencies) -> None:
    """Register ``name`` as :func:`register_sink_reference`'s attention with a rotary window: a query-key pair at
    distance ``d >= window`` (index distance: the rows' padding cancels) has each slowed channel's angle (a Llama
    halves layout channel ``c`` of frequency ``frequencies[c % (width / 2)]``, 0: not slowed) read at ``window + (d -
    window) / stretch`` instead of ``d``: its key turned ``d - that`` positions further, pair by pair, in float64."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(rep, dim=1).double(), value.repeat_interleave(rep, dim=1).double()
        q = query.double()
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        half = len(frequencies)
        length = q.shape[2]
        scores = torch.zeros(q.shape[0], q.shape[1], length, length, dtype=torch.float64)
        for i in range(length):
            for j in range(length):
                d = i - j
                key_j = k[:, :, j].clone()
                if d >= window:
                    turn = d - (window + (d - window) / stretch)
                    for c, frequency in enumerate(frequencies):
                        if frequency:
                            a, b = key_j[..., c].clone(), key_j[..., c + half].clone()
                            angle = frequency * turn
                            key_j[..., c] = a * math.cos(angle) - b * math.sin(angle)
                            key_j[..., c + half] = b * math.cos(angle) + a * math.sin(angle)
                scores[:, :, i, j] = (q[:, :, i] * key_j).sum(-1) * scaling
        return _reference_softmax(scores, bias, attention_mask, v, query.dtype), None

    _register_reference(name, attention)


def retained_rotary_reference_logits(
    make_original,
    model,
    input_ids,
    attention_mask,
    bias,
    max_wavelength,
    theta,
    knee=None,
    stretch=1.0,
    interpolation=1.0,
):
    """Logits of a rotary decoder converted with sinks / slopes (in ``bias``) and a rotary bound: its
    original architecture with the same weights, the inverse frequencies recomputed from ``theta``
    (``1 / theta^(2k/d)`` over the rotary width) and those of wavelength ``2 pi / f > max_wavelength``
    set to 0 (no rotation), and the reference attention with ``bias``. With a ``knee`` (and ``stretch`` or
    ``interpolation``), a Llama-layout model's rotary module is :class:`KneeRotaryReference` instead."""
    name = "hf_alibi_tests_sink_reference"
    register_sink_reference(name, bias)
    reference = make_original(attn_implementation=name)
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in n for n in missing), (missing, unexpected)
    for buffer_name, buffer in reference.named_buffers():
        if buffer_name.endswith("inv_freq"):
            width = 2 * buffer.shape[0]
            freq = [1.0 / theta ** (2 * k / width) for k in range(width // 2)]
            kept = [f if 2 * math.pi / f <= max_wavelength else 0.0 for f in freq]
            buffer.copy_(torch.tensor(kept, dtype=buffer.dtype))
            if knee is not None and (stretch != 1 or interpolation != 1):
                reference.model.rotary_emb = KneeRotaryReference(
                    width, theta, max_wavelength, knee, stretch, interpolation
                )
    reference = reference.to(torch.float32).eval()
    return reference(input_ids=input_ids, attention_mask=attention_mask).logits
