"""The run's configuration: the validated flags, frozen, in sections (model, parallel layout,
data, training, checkpoint, logging), and the model they describe (`model_config`, the
`model.config.ModelConfig` that builds, records and exports it).

A section's fields are the flags of the parser's groups it holds (`flags.py`), generated from
their declarations, so that a flag is declared in one place. (Not the other way round, flags
from dataclass fields as torchtitan's: Megatron-LM's flags are kept as spelled there, with
their switches that store False, aliases, deprecated spellings and refusals, which argparse
says directly and a field's metadata would only re-encode.) Built once, by `validate_args`;
writing to it raises, and a changed run is a new config (`replace`). Each flag also reads flat
(`config.hidden_size`), as Megatron-style code reads its `args`.
"""

import argparse
import dataclasses
import functools
import typing
from typing import Any, Dict, List, Optional, Tuple

from megatron_focus.config.flags import build_parser
from megatron_focus.model.config import ModelConfig
from megatron_focus.variants import settings_classes

# The parser's argument groups each section holds; a variant's settings are the model's, and
# Megatron-LM's flags that do nothing here or are refused (compat.py) are a section of their own.
GROUPS = {
    "model": ("model",),
    "parallel": ("parallelism",),
    "data": ("data",),
    "training": ("training", "DeepSpeed", "Megatron-LM flags done by DeepSpeed"),
    "checkpoint": ("checkpointing",),
    "logging": ("logging",),
    "launch": ("options",),  # the launcher's --local_rank, --yaml-cfg
}
MEGATRON_LM = "megatron_lm"
NAMES = {
    "model": "ModelFlags",
    "parallel": "ParallelConfig",
    "data": "DataConfig",
    "training": "TrainingConfig",
    "checkpoint": "CheckpointConfig",
    "logging": "LoggingConfig",
    "launch": "LaunchConfig",
    MEGATRON_LM: "MegatronLMConfig",
}


def _section_of(title: str) -> str:
    for section, titles in GROUPS.items():
        if title in titles:
            return section
    if any(title.startswith(f"{settings.prefix} (") for settings in settings_classes()):
        return "model"
    if title.startswith("Megatron-LM"):
        return MEGATRON_LM
    raise TypeError(f"flags.py's group {title!r} belongs to no section of the run config")


def _field_type(action: argparse.Action) -> Any:
    """The type a flag's value has: a switch's bool, its `type` (a parsing function's return
    annotation), a list for several values, Optional where the default is None."""
    if action.nargs == 0:
        kind = bool
    elif isinstance(action.type, type):
        kind = action.type
    elif action.type is not None:
        kind = typing.get_type_hints(action.type).get("return", str)
    else:
        kind = str
    if action.nargs not in (None, "?", 0):
        kind = List[kind]
    return Optional[kind] if action.default is None else kind


def _sections(parser: argparse.ArgumentParser) -> Dict[str, List[argparse.Action]]:
    """section -> its flags, each flag (dest) in the first group that declares it."""
    sections: Dict[str, List[argparse.Action]] = {}
    seen = set()
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.default != argparse.SUPPRESS and action.dest not in seen:  # not --help
                seen.add(action.dest)
                sections.setdefault(_section_of(group.title), []).append(action)
    return sections


def frozen_flags(name: str, actions: List[argparse.Action], module: str) -> type:
    """A frozen dataclass of these flags, typed as they parse, named `name` in `module` (so that
    a pickled one, a DataLoader worker's, finds its class)."""
    cls = dataclasses.make_dataclass(
        name, [(action.dest, _field_type(action)) for action in actions], frozen=True
    )
    cls.__module__ = module
    return cls


SECTIONS = {
    name: frozen_flags(NAMES[name], actions, __name__)
    for name, actions in _sections(build_parser()).items()
}
ModelFlags = SECTIONS["model"]
ParallelConfig = SECTIONS["parallel"]
DataConfig = SECTIONS["data"]
TrainingConfig = SECTIONS["training"]
CheckpointConfig = SECTIONS["checkpoint"]
LoggingConfig = SECTIONS["logging"]
LaunchConfig = SECTIONS["launch"]
MegatronLMConfig = SECTIONS[MEGATRON_LM]
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _late_settings() -> List[str]:
    """The flags of variants registered after this module was imported (a notebook's, a test's
    `register` call): the sections were generated before them, so they are held apart."""
    return [
        settings.key(f.name)
        for settings in settings_classes()
        for f in dataclasses.fields(settings)
        if settings.key(f.name) not in SECTION_OF
    ]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelFlags
    parallel: ParallelConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    launch: LaunchConfig
    megatron_lm: MegatronLMConfig
    late: Tuple[Tuple[str, Any], ...] = ()  # (flag, value) of late-registered variants' settings

    @classmethod
    def of(cls, flags: Dict[str, Any]) -> "RunConfig":
        """The config of every flag by name (a validated namespace's `vars`); other keys (a
        tool's own flags) are not the run's."""
        return cls(
            **{
                name: section(**{f.name: flags[f.name] for f in dataclasses.fields(section)})
                for name, section in SECTIONS.items()
            },
            late=tuple((key, flags[key]) for key in _late_settings() if key in flags),
        )

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        """The model these flags describe, built once (what builds, records and exports it)."""
        return ModelConfig.of(self)

    def at_interval(self, interval: Optional[int], iteration: int) -> bool:
        """Whether `iteration` is due for something done every `interval` iterations (never
        without one) and at the last: logging, evaluation, saving."""
        return (bool(interval) and iteration % interval == 0) or iteration == self.train_iters

    def __getattr__(self, name: str):
        """A flag, read flat: `config.hidden_size` is `config.model.hidden_size`."""
        section = SECTION_OF.get(name)
        if section is not None:
            return getattr(getattr(self, section), name)
        late = dict(self.late)
        if name not in late:
            raise AttributeError(f"the run config has no flag {name!r}")
        return late[name]

    def flags(self) -> Dict[str, Any]:
        """Every flag by name, as the parsed namespace held them."""
        return {
            **{
                f.name: getattr(section, f.name)
                for section in (getattr(self, name) for name in SECTIONS)
                for f in dataclasses.fields(section)
            },
            **dict(self.late),
        }

    def replace(self, **flags) -> "RunConfig":
        """A new config with these flags changed (as validated values: nothing is re-derived)."""
        late = dict(self.late)
        unknown = [name for name in flags if name not in SECTION_OF and name not in late]
        if unknown:
            raise TypeError(f"the run config has no flag {', '.join(unknown)}")
        return RunConfig(
            **{
                name: dataclasses.replace(
                    getattr(self, name),
                    **{k: v for k, v in flags.items() if SECTION_OF.get(k) == name},
                )
                for name in SECTIONS
            },
            late=tuple((k, flags.get(k, v)) for k, v in late.items()),
        )


def is_flag(name: str) -> bool:
    return name in SECTION_OF or name in _late_settings()
