"""Every buffer of a converted class gets its value from ``init_weights()`` after a meta-device build (what
FSDP's meta-device setup, ``init_empty_weights`` and a checkpoint missing a buffer do): the same value as the
class built on the CPU from the same config, never the garbage ``to_empty`` leaves."""

import pytest
import torch
from arch_cases import FULL_CASE_IDS, FULL_CASES

import hf_alibi

CONVERSIONS = {"paper": {}, "pretrained": {"preset": "pretrained"}}


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
@pytest.mark.parametrize("case", FULL_CASES, ids=FULL_CASE_IDS)
def test_meta_device_build_then_init_weights_fills_every_buffer(case, conversion):
    converted = hf_alibi.patch_model(case.make(), **CONVERSIONS[conversion])
    cls, config = type(converted), converted.config
    torch.manual_seed(0)
    on_cpu = cls(config)  # the reference: built normally, from the config alone
    with torch.device("meta"):
        on_meta = cls(config)
    on_meta.to_empty(device="cpu")
    for _, buffer in on_meta.named_buffers():
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))  # what an uninitialised buffer may hold
        else:
            buffer.fill_(-7)
    on_meta.init_weights()
    expected = dict(on_cpu.named_buffers())
    found = dict(on_meta.named_buffers())
    assert found.keys() == expected.keys()
    for name, buffer in found.items():
        torch.testing.assert_close(buffer, expected[name], rtol=0, atol=0, msg=f"buffer {name}")
