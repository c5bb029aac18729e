"""The run config: built once from the validated flags, in sections generated from the parser's
groups, and frozen."""

import dataclasses

import pytest

from megatron_focus.config.flags import build_parser
from megatron_focus.config.run_config import SECTIONS, RunConfig
from megatron_focus.config.validation import validate_args
from megatron_focus.training.arguments import parse_args


def test_each_flag_is_a_field_of_one_section_typed_as_it_parses():
    fields = {f.name: f for section in SECTIONS.values() for f in dataclasses.fields(section)}
    declared = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert set(fields) == declared
    assert sum(len(dataclasses.fields(s)) for s in SECTIONS.values()) == len(declared)
    model = {f.name: f.type for f in dataclasses.fields(SECTIONS["model"])}
    assert model["hidden_size"] is int and model["swiglu"] is bool
    assert "focus_groups" in model  # a variant's settings are the model's
    assert "tensor_model_parallel_size" in {
        f.name for f in dataclasses.fields(SECTIONS["parallel"])
    }


def test_the_config_is_frozen_and_a_changed_run_is_a_new_config():
    config = parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    assert isinstance(config, RunConfig)
    assert config.model.hidden_size == config.hidden_size == 64
    assert config.model.kv_channels == 16  # derived by validation
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 128
    wider = config.replace(hidden_size=128)
    assert (wider.hidden_size, config.hidden_size) == (128, 64)
    with pytest.raises(TypeError, match="no flag"):
        config.replace(hidden_sise=128)


def test_validation_leaves_the_parsed_flags_as_they_were():
    parsed = build_parser().parse_args(["--hidden-size", "64", "--num-attention-heads", "4"])
    before = dict(vars(parsed))
    config = validate_args(parsed, world_size=1)
    assert vars(parsed) == before and before["kv_channels"] is None
    assert config.flags().keys() == before.keys()
