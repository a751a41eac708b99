"""torch.compile(fullgraph=True) and torch.export on every preset and every declared conversion option.

The conversion options are read from their one declaration (``conversion_options()``): each row kind (learned
absolute table on a decoder and on an encoder, rotary, T5's relative bias) is converted with every option that applies
to it set away from its default at once, then with ``slope_scale`` (which excludes explicit slopes), then with the
``pretrained`` preset (README's own snippet). An option declared later is taken into the first conversion without
anyone remembering, once it has a value in ``VALUES`` (``test_every_declared_option_has_a_value`` says so).
Each compiled or exported model must trace as one graph and give the eager model's numbers; the preset's, at other
lengths too (where torch.compile makes the length symbolic).
"""

import pytest
import torch
from arch_cases import CASES

import hf_alibi
from hf_alibi.core.settings import conversion_options

CASE = {case.name: case for case in CASES}
LENGTH = 40  # past FOLD_MIN_QUERIES (the fold is taken on sdpa) and past every tiny model's original 16
ROWS = ("gpt2", "bert", "llama", "t5")  # absolute decoder, absolute encoder, rotary, relative
# a value away from the default for each declared option ("fitted": fit_slopes' per-layer slopes, explicit ones on T5)
VALUES = {
    "sinks": 2,
    "slope_scale": 0.5,
    "slopes": "fitted",
    "rotary_max_wavelength": 100.0,  # keeps a frequency of wavelength > the knee (63 tokens for theta 1e4)
    "rotary_knee": 12.0,  # inside the inputs' 40 positions: the slowed frequencies are traced past it
    "rotary_stretch": 4.0,
    "rotary_interpolation": 1.5,  # with the stretch: the knee's positions interpolated
    "rotary_window": 20,  # the window conversion (below): far pairs inside the inputs' 40 positions
    "rotary_window_stretch": 3.0,
    "position_mean": 4,
    "table_max_wavelength": 8.0,
}
EXCLUSIVE = {"slope_scale"}  # taken alone: it and explicit slopes exclude each other
# the rotary window maps distances where the stretch and the interpolation map positions: a conversion of its own
WINDOW, POSITION_MAPS = {"rotary_window", "rotary_window_stretch"}, {"rotary_stretch", "rotary_interpolation"}


def test_every_declared_option_has_a_value():
    assert set(VALUES) == {option.name for option in conversion_options()}


def _inputs(case) -> dict:
    inputs = case.inputs(2, LENGTH)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :5] = 0  # left padding: sinks are placed by it, and the bias is merged with it in the graph
    return {**inputs, "attention_mask": mask, "use_cache": False}


def _converted(name: str, conversion: str):
    case = CASE[name]
    model = case.make(attn_implementation="sdpa")
    if conversion == "pretrained":
        return hf_alibi.patch_model(model, preset="pretrained"), {"preset": "pretrained"}
    row = hf_alibi.get_architecture(case.model_type)
    names = [
        option.name
        for option in conversion_options()
        if option.metadata["applies"] is None or option.metadata["applies"](row, model.config)
    ]
    names = [n for n in names if (n in EXCLUSIVE) == (conversion == "scaled")]
    names = [n for n in names if n not in (POSITION_MAPS if conversion == "window" else WINDOW)]
    options = {}
    for option in names:
        value = VALUES[option]
        if value == "fitted" and case.kind == "seq2seq":  # fit_slopes measures decoder-only and encoder models
            value = [0.3 / (head + 1) for head in range(model.config.num_attention_heads)]  # explicit, every layer
        elif value == "fitted":
            ids = case.inputs(1, 12, seed=5)["input_ids"]  # within the original length
            value = hf_alibi.fit_slopes(model, ids, sinks=options.get("sinks", 0))
        options[option] = value
    return hf_alibi.patch_model(model, **options), options


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("name", "conversion"),
    [(name, kind) for name in ROWS for kind in ("options", "scaled", "pretrained")] + [("llama", "window")],
)
def test_fullgraph_compile_on_every_option(name, conversion):
    model, options = _converted(name, conversion)
    assert options  # every row takes some option
    inputs = _inputs(CASE[name])
    expected = _logits(model, inputs)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # one graph, or an error
    torch.testing.assert_close(_logits(compiled, inputs), expected, rtol=0, atol=1e-5)
    if conversion == "pretrained":  # README's snippet: unpadded inputs (no mask) with the cache generate() uses
        # at two lengths: torch.compile recompiles with the length symbolic (automatic dynamic shapes), where the
        # fold handed SDPA's is_causal a SymBool and failed
        for length in (LENGTH + 24, LENGTH + 8):
            longer = CASE[name].inputs(1, length, seed=length)
            torch.testing.assert_close(_logits(compiled, longer), _logits(model, longer), rtol=0, atol=1e-5)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs: dict):
        return self.model(**inputs, use_cache=False).logits


@pytest.mark.parametrize(("name", "conversion"), [(name, "options") for name in ROWS] + [("llama", "window")])
def test_export_with_every_option(name, conversion):
    model, _ = _converted(name, conversion)
    inputs = {k: v for k, v in _inputs(CASE[name]).items() if k != "use_cache"}
    program = torch.export.export(_Logits(model), (inputs,))
    other = {k: (v.flip(0) if k == "attention_mask" else v) for k, v in inputs.items()}  # padding on the other row
    for batch in (inputs, other):
        with torch.no_grad():
            torch.testing.assert_close(program.module()(batch), _Logits(model)(batch), rtol=0, atol=1e-5)
