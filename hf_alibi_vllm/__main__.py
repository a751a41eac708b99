"""``python -m hf_alibi_vllm MODEL [vLLM server options]``: vLLM's OpenAI-compatible server on a converted folder, the
same server as ``vllm serve MODEL`` (:mod:`hf_alibi_vllm.server`, which this runs as a file; see there why).
"""

import os
import sys

from hf_alibi_vllm import server

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, server.__file__, *sys.argv[1:]])
