"""Models trained with ALiBi: nothing is converted, their attention runs on hf_alibi's paths (strategy ``"native"``).

Each row is plain data read by ``hf_alibi.native``: where the fused QKV is and its layout, which slopes, where the
bias is added. Checked against transformers' own classes (tests/architectures/test_native_alibi.py).
"""

from hf_alibi.native.rows import BLOCKS, MPT, NativeArchitecture

ROWS: list[NativeArchitecture] = [
    # the paper's slopes; bias added after q.k / sqrt(d); fused QKV (H, 3, d); the attention adds the residual
    NativeArchitecture("bloom", "h.*.self_attention", "query_key_value", "dense", residual=True),
    # MPT's slopes (attn_config.alibi_bias_max, its own order); softmax_scale; fused QKV (3, H, d); clip_qkv
    NativeArchitecture(
        "mpt", "blocks.*.attn", "Wqkv", "out_proj", layout=BLOCKS, slopes=MPT, bias_max="attn_config.alibi_bias_max",
        scaling="softmax_scale", dropout="attn_dropout_p", cache="cache", clip="clip_qkv",
        alibi_flag="attn_config.alibi", boolean_mask=True,
    ),
    # Falcon-RW: BLOOM's slopes rounded to bf16 and each key's bias m * p rounded to bf16 (as its code does), the
    # bias added before the 1/sqrt(d) scaling (the slopes scaled by it); rotary Falcons refused
    NativeArchitecture(
        "falcon", "h.*.self_attention", "query_key_value", "dense", bias_before_scaling=True, slope_dtype="bfloat16",
        key_rounding="bfloat16", alibi_flag="alibi",
        requires=(("multi_query", False), ("new_decoder_architecture", False)), kv_heads="num_kv_heads",
        base_bias_switch="use_alibi", boolean_mask=True,
    ),
]  # fmt: skip
