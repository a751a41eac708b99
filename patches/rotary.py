"""Rotary decoders: the base model's ``rotary_emb`` answers the identity rotation (strategy ``"rotary"``).

The rotary fields (rope_parameters, partial_rotary_factor) stay: they build the original layers and
size nothing; max_position_embeddings is the one length limit. Checked against an explicit-bias
reference (tests/reference.py), eager and sdpa, with grouped KV heads, sliding windows (mistral, qwen2,
gemma2, gemma3_text, cohere2, exaone4, ministral, mixtral, olmo3, qwen2_moe), soft-capping (gemma2: the
bias is added after the cap, see core/dense.py), partial rotary (phi3, stablelm, gpt_neox, phi, persimmon,
glm, glm4, nemotron), layers without rotary (smollm3) and mixture-of-experts MLPs (mixtral, olmoe,
qwen2_moe, qwen3_moe, granitemoe).
"""

# relative: the command line reads these rows from hf_alibi's folder without importing the package (torch)
from ..core.architectures import Architecture

# Llama's layout (the row's defaults): ``rotary_emb`` on the base model, ``layers.*.self_attn``.
LLAMA_LAYOUT = (
    "apertus", "arcee", "cohere", "cohere2", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "glm",
    "glm4", "granite", "granitemoe", "hunyuan_v1_dense", "llama", "ministral", "mistral", "mixtral",
    "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phi3", "qwen2", "qwen2_moe",
    "qwen3", "qwen3_moe", "seed_oss", "smollm3", "stablelm", "starcoder2",
)  # fmt: skip

ROWS: list[Architecture] = [
    Architecture("gpt_neox", "rotary", attention=("layers.*.attention",)),
    *(Architecture(model_type, "rotary") for model_type in LLAMA_LAYOUT),
]
