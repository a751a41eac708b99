"""The self-contained code copied into converted checkpoints (see modeling_alibi.py)."""
