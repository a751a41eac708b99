"""Each forward hands its layers one AlibiForward in the open (``core/forward.py``): nothing kept per thread, nothing
process-global, nothing left behind (issues 13 and 34.2).

Two models whose forwards nest (a teacher run inside a student's forward, as distillation does), or two threads
running one model at once with different lengths and padding, each get exactly what they get alone; the layers of
one forward share one merged mask; a forward that ends, also by raising, leaves nothing a later call could read.
"""

import gc
import threading
import weakref

import pytest
import torch
from tiny import random_ids, tiny_gpt2

import hf_alibi
from hf_alibi.core import forward as forward_module
from hf_alibi.core.forward import KEYWORD, AlibiForward


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def capture_forwards(attention: torch.nn.Module) -> tuple[list, object]:
    """The AlibiForward each call of ``attention`` receives among its keyword arguments (transformers passes the
    model's down to every attention module), and the hook's handle."""
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs.get(KEYWORD))

    return seen, attention.register_forward_pre_hook(hook, with_kwargs=True)


def no_forward_left(model) -> bool:
    """Nothing of a finished forward is reachable: none running in this context, none kept on the model."""
    shared = next(m for m in model.modules() if isinstance(m, hf_alibi.AlibiBias)).shared
    return (
        forward_module._RUNNING.get() is None
        and shared.traced is None
        and set(vars(shared))
        == {
            "decoding_rows",
            "traced",
        }
    )


def test_the_model_hands_every_layer_one_forward_through_its_keyword_arguments():
    model = hf_alibi.set_attention_path(hf_alibi.patch_model(tiny_gpt2(n_layer=3)), "bias")
    hooks = [capture_forwards(block.attn) for block in model.transformer.h]
    ids, mask = random_ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    logits(model, ids, mask)
    for _, handle in hooks:
        handle.remove()
    (forward,) = {id(seen[0]): seen[0] for seen, _ in hooks}.values()  # the same object in every layer
    assert isinstance(forward, AlibiForward) and forward.builds == 1  # one merged mask, shared by the three
    assert forward.documents is None and forward.paged is None
    packed = torch.cat([torch.arange(4), torch.arange(5)])[None]  # a packed row: two documents
    seen, handle = capture_forwards(model.transformer.h[0].attn)
    with torch.no_grad():
        model(random_ids(1, 9), position_ids=packed)
    handle.remove()
    assert seen[0].documents.tolist() == [[0, 0, 0, 0, 4, 4, 4, 4, 4]]


def test_each_model_has_its_own_forward_and_nested_forwards_do_not_mix():
    student = hf_alibi.patch_model(tiny_gpt2(attn_implementation="eager", n_layer=3))
    teacher = hf_alibi.patch_model(tiny_gpt2(seed=1, attn_implementation="eager", n_head=8, n_embd=64))
    ids, other = random_ids(2, 9), random_ids(1, 13, seed=2)
    alone_student, alone_teacher = logits(student, ids), logits(teacher, other)
    inner = {}

    def run_teacher(module, args, output):  # after the student's first layer, before its second
        inner["teacher"] = logits(teacher, other)

    handle = student.transformer.h[0].register_forward_hook(run_teacher)
    seen, capture = capture_forwards(student.transformer.h[2].attn)
    nested = logits(student, ids)
    handle.remove(), capture.remove()
    assert seen[0].builds == 1  # the teacher's forward neither replaced nor dropped the student's mask
    torch.testing.assert_close(nested, alone_student, rtol=0, atol=0)
    torch.testing.assert_close(inner["teacher"], alone_teacher, rtol=0, atol=0)
    assert no_forward_left(student) and no_forward_left(teacher)


def test_a_forward_that_raises_leaves_nothing_behind():
    # what a forward made lives as long as it: also one that raised (a hook after the first layer's mask was made)
    model = hf_alibi.set_attention_path(hf_alibi.patch_model(tiny_gpt2(n_layer=3)), "bias")
    seen, capture = capture_forwards(model.transformer.h[0].attn)

    def fail(module, args, output):
        assert seen[0].builds == 1  # made by the first layer
        raise RuntimeError("stop")

    handle = model.transformer.h[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="stop"):
        logits(model, random_ids(2, 9))
    handle.remove(), capture.remove()
    gone = weakref.ref(seen.pop())
    gc.collect()
    assert gone() is None and no_forward_left(model)


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
    assert no_forward_left(model)


def test_a_direct_forward_call_and_a_direct_base_call_hand_their_layers_one_forward():
    # PEFT's AdaLoRA calls model.forward(...) itself, past nn.Module's hooks, and OPT's head runs its inner decoder,
    # past the base model's: the converted class's forward makes the AlibiForward. A caller may run the base model
    # itself: its pre-hook makes it, its hook (also on a raise) leaves it
    from arch_cases import CASES

    model = hf_alibi.set_attention_path(hf_alibi.patch_model(next(c for c in CASES if c.name == "opt").make()), "bias")
    seen, capture = capture_forwards(model.model.decoder.layers[-1].self_attn)
    with torch.no_grad():
        model.forward(input_ids=random_ids(2, 9))
        model.model(input_ids=random_ids(2, 9))
    capture.remove()
    assert [forward.builds for forward in seen] == [1, 1] and seen[0] is not seen[1]
    assert no_forward_left(model)


def test_layers_whose_caller_drops_keyword_arguments_read_the_running_forward():
    # StableLM's decoder layers call self_attn without their **kwargs (transformers 5.x): the layers read the forward
    # from the context of the model's forward that made it. Left padding with sinks is placed by it: each padded
    # row's logits equal the same row alone, unpadded
    from arch_cases import CASES

    case = next(c for c in CASES if c.model_type == "stablelm")
    model = hf_alibi.patch_model(case.make(), sinks=2)
    ids = random_ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    padded = logits(model, ids, mask)
    alone = logits(model, ids[1:, 4:])
    torch.testing.assert_close(padded[1, 4:], alone[0], rtol=0, atol=1e-5)
    assert no_forward_left(model)


def gradients(model, inputs: dict, checkpointing: bool) -> torch.Tensor:
    """The loss's gradient over every weight, with or without transformers' gradient checkpointing."""
    model.train().zero_grad()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def packed_row() -> dict:
    return {"input_ids": random_ids(1, 14), "position_ids": torch.cat([torch.arange(6), torch.arange(8)])[None]}


def left_padded() -> dict:
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    return {"input_ids": random_ids(2, 12), "attention_mask": mask}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' gradient_checkpointing_enable, renamed in 5.x
@pytest.mark.parametrize(
    "name, options, inputs",
    [
        ("llama", {"sinks": 2}, left_padded),  # the forward reaches the layers in their keyword arguments
        ("gpt2", {}, packed_row),
        ("stablelm", {"sinks": 2}, left_padded),  # its decoder layers drop them: the running forward
        ("bloom", None, packed_row),  # trained with ALiBi (hf_alibi/native/): its blocks take fixed arguments
    ],
)
def test_gradient_checkpointing_recomputes_each_layer_inside_its_forward(name, options, inputs):
    # The backward pass recomputes a checkpointed layer after the forward has ended; it must see the same rows,
    # documents and sinks (the gradients without checkpointing are the reference). A recomputation that loses them
    # is off by up to 0.05 (llama with sinks), 0.045 (stablelm), 0.002 (bloom's packed row).
    from arch_cases import CASES, NATIVE_CASES

    if options is None:
        model = hf_alibi.patch_model(next(c for c in NATIVE_CASES if c.model_type == name).make())
    else:
        model = hf_alibi.patch_model(next(c for c in CASES if c.model_type == name).make(), **options)
    inputs = inputs()
    torch.testing.assert_close(gradients(model, inputs, True), gradients(model, inputs, False), rtol=0, atol=1e-6)
