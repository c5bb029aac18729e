"""`--yaml-cfg PATH`: a run's flags from a YAML file laid out as Megatron-LM's.

Megatron-LM (megatron/training/yaml_arguments.py) reads the whole configuration from the file and
ignores the command line: top-level keys are its flags' names with underscores (`lr`,
`micro_batch_size`), and two sections hold Megatron-Core's config fields: `language_model:`
(TransformerConfig: `num_layers`, `layernorm_epsilon`, `activation_func` ...) and
`model_parallel:` (ModelParallelConfig: `tensor_model_parallel_size`, `bf16` ...). `${VAR}` in a
value is the environment variable. Here the file becomes the command line it stands for and goes
through the same parser and checks; a flag given beside `--yaml-cfg` is refused rather than
silently ignored. A key that names nothing here is ignored, as Megatron-LM's loader ignores it
(its shipped files hold keys of flags it has since removed), with a warning that names it.
"""

import argparse
import difflib
import functools
import os
import re
import warnings
from typing import Dict, List

SECTIONS = {
    "language_model": "megatron.core.transformer:TransformerConfig",
    "model_parallel": "megatron.core.model_parallel_config:ModelParallelConfig",
}
# Megatron-Core's field names for flags named otherwise (their destinations here).
RENAMED = {
    "layernorm_epsilon": "norm_epsilon",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "num_moe_experts": "num_experts",
    "fp8": "fp8_format",
    "persist_layer_norm": None,  # --no-persist-layer-norm: no effect here
    "bias_activation_fusion": None,  # --no-bias-gelu-fusion / --no-bias-swiglu-fusion
    "tp_comm_atomic_ag": None,  # Transformer Engine's, as --tp-comm-*: no effect here
    "tp_comm_atomic_rs": None,
}
ACTIVATIONS = {"gelu": [], "swiglu": ["--swiglu"], "squared_relu": ["--squared-relu"]}
# Command-line flags a launcher adds beside --yaml-cfg.
LAUNCHER = ("--local-rank", "--local_rank", "--deepspeed", "--deepspeed_config")
ENV = re.compile(r"\$\{(\w+)\}")


def yaml_argv(path: str, parser: argparse.ArgumentParser) -> List[str]:
    """The command line that the YAML file at `path` stands for."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--yaml-cfg {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--yaml-cfg {path}: not YAML ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--yaml-cfg {path}: expected keys and values, as Megatron-LM's")
    settings = _flatten(config, path)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv, problems, unknown = _activation(settings, path), [], []
    for key, value in settings.items():
        dest = RENAMED.get(key, key)
        if dest is None or value is None:  # no effect here, or unset: the default
            continue
        try:
            if dest in actions:
                argv += _words(actions[dest], _with_environment(value, key), key)
            elif _is_core_field(key, value):
                continue
            else:
                unknown.append(_unknown(key, actions))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError(f"--yaml-cfg {path}: " + "; ".join(problems))
    if unknown:
        warnings.warn(
            f"--yaml-cfg {path}: ignoring {', '.join(unknown)}: no such flag or Megatron-Core "
            "config field (Megatron-LM ignores them too)",
            stacklevel=2,
        )
    return argv


def _flatten(config: dict, path: str) -> Dict[str, object]:
    """The top-level keys and both sections' in one table, as Megatron-LM merges them."""
    settings = {k: v for k, v in config.items() if k not in SECTIONS}
    for section in SECTIONS:
        fields = config.get(section) or {}
        if not isinstance(fields, dict):
            raise ValueError(f"--yaml-cfg {path}: {section}: expected keys and values")
        twice = sorted(set(fields) & set(settings))
        if twice:
            raise ValueError(f"--yaml-cfg {path}: {', '.join(twice)} given twice ({section})")
        settings.update(fields)
    return settings


def _activation(settings: Dict[str, object], path: str) -> List[str]:
    """Megatron-Core's `activation_func` and `gated_linear_unit`, as this trainer's flags."""
    name = settings.pop("activation_func", None)
    gated = settings.pop("gated_linear_unit", None)
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(
            f"--yaml-cfg {path}: activation_func {name}: one of {', '.join(ACTIVATIONS)}"
        )
    if gated and name != "swiglu" and not settings.get("swiglu"):
        raise ValueError(f"--yaml-cfg {path}: gated_linear_unit: only with activation_func swiglu")
    return list(ACTIVATIONS.get(name, []))


def _with_environment(value, key: str):
    """`${VAR}` in a text value: the environment variable, as Megatron-LM's loader reads it."""
    if not isinstance(value, str):
        return value
    missing = [name for name in ENV.findall(value) if name not in os.environ]
    if missing:
        raise ValueError(f"{key}: environment variable {missing[0]} is not set")
    return ENV.sub(lambda m: os.environ[m.group(1)], value)


def _words(action: argparse.Action, value, key: str) -> List[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch: the value its flag stores, or its default
        if not isinstance(value, bool):
            raise ValueError(f"{key} {value}: expected true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else f"--no-{flag[2:]}"]
        return [flag] if value == action.const else []
    if not isinstance(value, list):
        return [flag, str(value)]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [flag, *map(str, value)]
    return [flag, ",".join(map(str, value))]  # one value: Megatron's tuples, as "127,0"


def _is_core_field(key: str, value) -> bool:
    """A Megatron-Core config field that this trainer sets itself: accepted at its default,
    refused at any other value."""
    default = _core_defaults().get(key, _UNKNOWN)
    if default is _UNKNOWN:
        return False
    if value != default:
        raise ValueError(
            f"{key} {value}: Megatron-Core's {key} is set by this trainer, which takes only "
            f"its default ({default})"
        )
    return True


def _unknown(key: str, actions: Dict[str, argparse.Action]) -> str:
    """`key`, with the closest flag's name where one is close (a misspelling)."""
    close = difflib.get_close_matches(key, list(actions), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


_UNKNOWN = object()


@functools.lru_cache(maxsize=None)
def _core_defaults() -> Dict[str, object]:
    """The fields of Megatron-Core's TransformerConfig and ModelParallelConfig, and defaults."""
    import dataclasses
    import importlib

    defaults = {}
    for target in SECTIONS.values():
        module, _, name = target.partition(":")
        for field in dataclasses.fields(getattr(importlib.import_module(module), name)):
            defaults[field.name] = (
                field.default if field.default is not dataclasses.MISSING else None
            )
    return defaults


def check_command_line(argv: List[str]) -> None:
    """Megatron-LM ignores every flag beside --yaml-cfg; here they are refused, by name."""
    beside = [
        word.split("=")[0]
        for word in argv
        if word.startswith("--")
        and not word.startswith("--yaml-cfg")
        and word.split("=")[0] not in LAUNCHER
    ]
    if beside:
        raise ValueError(
            f"{', '.join(beside)} beside --yaml-cfg: the YAML file holds the whole configuration "
            "(Megatron-LM ignores the command line then); give them in the file"
        )
