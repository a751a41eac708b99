"""Run at the start of every Python process whose ``PYTHONPATH`` holds this folder
(:func:`hf_alibi_boot.vllm.environment`): hides what cannot load (:mod:`hf_alibi_boot.vllm`) before anything imports
transformers, in vLLM's own subprocesses too (its registry inspects a model class in a fresh ``python -m
vllm.model_executor.models.registry``). Then runs the ``sitecustomize`` this one stands in front of, if the
environment has one."""

import importlib.machinery
import importlib.util
import os
import sys

import hf_alibi_boot.vllm  # noqa: F401  (hides on import)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _spec is not None and _spec.loader is not None:
    _next = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_next)
