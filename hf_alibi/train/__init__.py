"""Training helpers for scripts/run_clm.py, the notebooks, the benchmarks and the tests (recovery after a conversion
is its own wing, :mod:`hf_alibi.recover`): ``data`` (the embedded corpus, the standard library's sources, and the BPE
tokenizer trained on it; ``hf_alibi.data`` is its old name, a deprecated alias), ``length_scaling`` (train short:
composer's sequence-length scaling for the Trainer), ``distributed`` (what run_clm.py needs for FSDP besides
accelerate). Nothing is imported here: import the module needed.
"""
