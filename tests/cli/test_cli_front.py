"""What the command line's front (hf_alibi/cli/checks.py, run before torch loads) reads of a checkpoint without
transformers agrees with what the library reads with it: the head count of config.json, the architecture rows, and
which option values are refused (``plan_conversion``'s answer, the independent reference); serve's own options, read
by the one reader (hf_alibi/cli/parser.py: take_option) from their declarations."""

from __future__ import annotations

import argparse
import re

import pytest
import transformers

import hf_alibi
from hf_alibi.cli import checks as cli_checks
from hf_alibi.cli.checks import (
    CliError,
    builtin_row,
    check_conversion_values,
    config_heads,
    serve_options,
    serving_engine,
)
from hf_alibi.cli.parser import SERVE_FLAGS, build_parser, take_option
from hf_alibi.serve.request_checks import DEFAULT_CAP, LIMIT_FLAGS, Limits

TYPES = sorted(hf_alibi.supported_model_types())


@pytest.mark.parametrize("model_type", [*TYPES, *sorted(hf_alibi.native_model_types())])
def test_the_head_count_of_config_json_is_the_one_transformers_reads(model_type):
    config = transformers.CONFIG_MAPPING[model_type](num_attention_heads=2)  # divides every default width
    assert config.num_attention_heads == 2
    assert config_heads(config.to_dict()) == 2


def test_the_rows_read_without_torch_are_the_registrys():
    for model_type in TYPES:
        assert builtin_row(model_type).to_dict() == hf_alibi.get_architecture(model_type).to_dict(), model_type
    for model_type in hf_alibi.native_model_types():
        assert builtin_row(model_type) is None  # nothing to convert: the job says so


OPTIONS = [
    {},
    {"sinks": -1},
    {"sinks": 2},
    {"slope_scale": 0.0},
    {"slope_scale": 0.5, "slopes": [1.0, 0.5, 0.25, 0.125]},
    {"slopes": [1.0, 0.5, 0.25, 0.125]},
    {"slopes": [1.0, 0.5]},
    {"slopes": [1.0, 0.5, 0.25, float("nan")]},
    {"rotary_max_wavelength": 100.0},
    {"rotary_max_wavelength": -1.0},
    {"position_mean": 16},
    {"position_mean": -2},
    {"table_max_wavelength": 0.0},
    {"table_max_wavelength": 1.0},
    {"table_max_wavelength": 64.0},
    {"heads": 3},
    {"encoder_variant": "nonsymmetric"},
    {"preset": "pretrained"},
    {"rotary_stretch": 3.0},  # needs a knee: refused without the preset's
    {"preset": "pretrained", "rotary_stretch": 3.0},
    {"preset": "pretrained", "rotary_stretch": 1.0, "rotary_interpolation": 1.5},
    {"preset": "pretrained", "rotary_interpolation": 0.5},
]


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "llama", "t5"])
@pytest.mark.parametrize("given", OPTIONS, ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()) or "none")
def test_the_front_refuses_what_plan_conversion_refuses_and_nothing_else(model_type, given, tmp_path):
    config = transformers.CONFIG_MAPPING[model_type](num_attention_heads=4)
    config.save_pretrained(tmp_path)
    try:
        hf_alibi.plan_conversion(config, **given)
        refused = False
    except ValueError:
        refused = True
    args = argparse.Namespace(
        src=str(tmp_path), heads=None, encoder_variant=None, preset=None, **dict.fromkeys(cli_checks.OPTIONS)
    )
    for name, value in given.items():
        setattr(args, name, value)
    try:
        check_conversion_values(args)
        front = False
    except CliError as error:
        front = True
        assert "\n" not in str(error)
    assert front == refused, (model_type, given)


@pytest.mark.parametrize(
    "argv, values, rest",
    [
        (["m", "--port", "8000"], [], ["m", "--port", "8000"]),
        (["m", "--engine", "vllm", "--port", "8000"], ["vllm"], ["m", "--port", "8000"]),
        (["m", "--engine=vllm", "--engine", "transformers"], ["vllm", "transformers"], ["m"]),
        (["m", "--port", "8000", "--engine"], [None], ["m", "--port", "8000"]),  # no value: None, said by the check
        (["m", "--engine", "--port", "8000"], ["--port"], ["m", "8000"]),  # the next word is the value, as argparse
    ],
)
def test_the_one_reader_of_a_passed_on_option(argv, values, rest):
    assert take_option(argv, "engine") == (values, rest)


def test_serve_options_are_read_from_their_declarations():
    """serve's own flags are declared once (SERVE_FLAGS: its help and usage), read by take_option in each spelling
    flag_spellings gives, and taken out of what goes to the engine's server; the port stays."""
    assert [f.name for f in SERVE_FLAGS] == ["engine", *LIMIT_FLAGS]
    assert serving_engine(["m", "--port", "8000"]) == ("transformers", ["m", "--port", "8000"])
    assert serving_engine(["m", "--engine=vllm"]) == ("vllm", ["m"])
    assert serve_options(["--port", "8000"]) == (Limits(), ["--port", "8000"])
    assert Limits().new_tokens == DEFAULT_CAP
    assert serve_options(["--max_new_tokens_cap=8", "--port", "8000"]) == (Limits(new_tokens=8), ["--port", "8000"])
    argv = ["--read-timeout", "2.5", "--idle_timeout=1", "--max-body-bytes", "100", "--max-prompt-tokens", "9"]
    assert serve_options(argv) == (Limits(prompt_tokens=9, body_bytes=100, read_timeout=2.5, idle_timeout=1.0), [])
    limits = serve_options(["--max-concurrent-requests", "4", "--max-queued-requests=8", "--port", "1"])
    assert limits == (Limits(concurrent=4, queued=8), ["--port", "1"])
    for argv, message in [
        (["--max-new-tokens-cap"], "takes a positive number of new tokens per request (got None)"),
        (["--port", "70000"], "argument --port: invalid port '70000'"),
        (["--read-timeout", "0"], "--read-timeout takes a positive number of seconds (got '0')"),
        (["--max-body-bytes", "1.5"], "--max-body-bytes takes a positive number of bytes (got '1.5')"),
    ]:
        with pytest.raises(CliError, match=re.escape(message)):
            serve_options(argv)
    usage = build_parser().commands["serve"].format_usage()
    assert usage.startswith("usage: hf-alibi serve MODEL [--engine transformers|vllm] [--max-new-tokens-cap N")
