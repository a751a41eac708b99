"""What the command line's front (hf_alibi/cli/checks.py, run before torch loads) reads of a checkpoint without
transformers agrees with what the library reads with it: the head count of config.json, the architecture rows, and
which option values are refused (``plan_conversion``'s answer, the independent reference)."""

from __future__ import annotations

import argparse

import pytest
import transformers

import hf_alibi
from hf_alibi.cli import checks as cli_checks
from hf_alibi.cli.checks import CliError, builtin_row, check_conversion_values, config_heads

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
    args = argparse.Namespace(src=str(tmp_path), heads=None, encoder_variant=None, **dict.fromkeys(cli_checks.OPTIONS))
    for name, value in given.items():
        setattr(args, name, value)
    try:
        check_conversion_values(args)
        front = False
    except CliError as error:
        front = True
        assert "\n" not in str(error)
    assert front == refused, (model_type, given)
