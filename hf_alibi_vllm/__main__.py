"""``python -m hf_alibi_vllm MODEL [vLLM server options]``: vLLM's OpenAI-compatible server on a converted folder, the
same server as ``vllm serve MODEL`` (its api_server entry: every option is vLLM's), started with
:func:`hf_alibi_vllm.environment`, so that every process of the server hides what cannot load first.
"""

import os
import sys

import hf_alibi_vllm
from hf_alibi_vllm import server

if __name__ == "__main__":
    argv = [sys.executable, server.__file__, *sys.argv[1:]]
    os.execve(sys.executable, argv, hf_alibi_vllm.environment())
