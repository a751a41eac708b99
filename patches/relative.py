"""Learned relative position biases, removed (strategy ``"relative"``)."""

# relative: the command line reads these rows from hf_alibi's folder without importing the package (torch)
from ..core.architectures import Architecture

ROWS: list[Architecture] = [
    Architecture(
        "t5", "relative",
        position=("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention?"),
        attention=("encoder.block.*.layer.0.SelfAttention", "decoder.block.*.layer.0.SelfAttention?"),
        bidirectional=True,
        removed_config_fields=("relative_attention_num_buckets", "relative_attention_max_distance"),
    ),
]  # fmt: skip
