"""The merged mask the layers share lives per model and per thread: nothing process-global (issue 13).

Two models whose forwards nest (a teacher run inside a student's forward, as distillation does), or two
threads running one model at once with different lengths and padding, each get exactly what they get alone.
"""

import threading

import pytest
import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_each_model_has_its_own_cache_and_nested_forwards_do_not_mix():
    student = hf_alibi.patch_model(tiny_gpt2(attn_implementation="eager", n_layer=3))
    teacher = hf_alibi.patch_model(tiny_gpt2(seed=1, attn_implementation="eager", n_head=8, n_embd=64))
    assert student.transformer.h[0].attn.alibi.masks is not teacher.transformer.h[0].attn.alibi.masks
    ids, other = random_ids(2, 9), random_ids(1, 13, seed=2)
    alone_student, alone_teacher = logits(student, ids), logits(teacher, other)
    inner = {}

    def run_teacher(module, args, output):  # after the student's first layer, before its second
        inner["teacher"] = logits(teacher, other)

    handle = student.transformer.h[0].register_forward_hook(run_teacher)
    masks = student.transformer.h[0].attn.alibi.masks
    before = masks.builds
    nested = logits(student, ids)
    handle.remove()
    assert masks.builds == before + 1  # the teacher's forward neither replaced nor released the student's mask
    torch.testing.assert_close(nested, alone_student, rtol=0, atol=0)
    torch.testing.assert_close(inner["teacher"], alone_teacher, rtol=0, atol=0)


def test_a_forward_that_raises_leaves_no_mask_behind():
    # the masks live for one forward, also one that raised (a hook after the masks were made)
    model = hf_alibi.set_attention_path(hf_alibi.patch_model(tiny_gpt2(n_layer=3)), "bias")
    masks = model.transformer.h[0].attn.alibi.masks

    def fail(module, args, output):
        assert masks.merged is not None  # made by the first layer
        raise RuntimeError("stop")

    handle = model.transformer.h[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="stop"):
        logits(model, random_ids(2, 9))
    handle.remove()
    assert masks.merged is None


def test_two_threads_running_one_model_see_only_their_own_mask():
    model = hf_alibi.patch_model(tiny_gpt2(attn_implementation="eager", n_layer=4))
    jobs = []
    for n in (7, 11, 23, 5):
        ids, mask = random_ids(2, n, seed=n), torch.ones(2, n, dtype=torch.long)
        mask[0, : n // 3] = 0  # left padding: the merged mask differs per input, not only per length
        jobs.append((ids, mask, logits(model, ids, mask)))
    errors = []
    start = threading.Barrier(2)

    def worker(offset):
        start.wait()
        for i in range(12):
            ids, mask, expected = jobs[(i + offset) % len(jobs)]
            if not torch.equal(logits(model, ids, mask), expected):
                errors.append((offset, i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert model.transformer.h[0].attn.alibi.masks.merged is None  # released by each forward


def test_a_direct_forward_call_leaves_no_mask_behind():
    # PEFT's AdaLoRA calls model.forward(...) itself, past nn.Module's hooks, and OPT's head runs its inner decoder,
    # past the base model's: the masks made for that forward still go with it (the converted class's forward)
    from arch_cases import CASES

    model = hf_alibi.set_attention_path(hf_alibi.patch_model(next(c for c in CASES if c.name == "opt").make()), "bias")
    masks = model.model.decoder.layers[0].self_attn.alibi.masks
    before = masks.builds
    with torch.no_grad():
        model.forward(input_ids=random_ids(2, 9))
    assert masks.builds == before + 1 and masks.merged is None
