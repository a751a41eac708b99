"""torch.export of a converted model with a dynamic sequence length accepts every length.

The path choice by query count (``FOLD_MIN_QUERIES``) must not become a guard of the exported program
(a program exported at 40 tokens rejected inputs shorter than 32); plain GPT-2 exports with a
minimum of 2, and so must its ALiBi conversion.
"""

import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_exported_program_accepts_every_length():
    model = Logits(hf_alibi.patch_model(tiny_gpt2()))
    length = torch.export.Dim("length", min=2, max=4096)
    program = torch.export.export(model, (random_ids(1, 40),), dynamic_shapes={"input_ids": {1: length}})
    for n in (2, 5, 31, 32, 100):  # both sides of FOLD_MIN_QUERIES, and past n_positions (16)
        ids = random_ids(1, n, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids), model(ids), rtol=0, atol=1e-5)
