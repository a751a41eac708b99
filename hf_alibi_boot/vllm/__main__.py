"""``python -m hf_alibi_boot.vllm MODEL [vLLM server options]``: vLLM's OpenAI-compatible server on a converted folder,
the same server as ``vllm serve MODEL`` (its api_server entry: every option is vLLM's), started with
:func:`hf_alibi_boot.vllm.environment`, so that every process of the server hides what cannot load first.
"""

import sys

from hf_alibi_boot.vllm.server import exec_server

if __name__ == "__main__":
    exec_server(sys.argv[1:])
