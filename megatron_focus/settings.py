"""An attention variant's settings as one schema: a frozen dataclass whose fields generate the
variant's flags, their checks and the keys its checkpoints record.

A subclass names its prefix, `class FocusConfig(VariantSettings, prefix="focus")`, and declares
its fields with `setting(...)`: each becomes a `--<prefix>-<name>` flag of `pretrain_gpt.py` and,
when it is a model setting, a `<prefix>_<name>` key of `model_args.json`, compared when a
checkpoint is loaded. The module imports nothing heavy (`pretrain_gpt.py --help` reads it).
"""

import argparse
import dataclasses
from typing import ClassVar, List

# What a setting is to the rest of the framework: part of what the model computes (recorded in
# model_args.json, compared on load, exported), an inference setting (free to change, exported as
# the HF model's default), or a kernel setting of this run only.
MODEL, INFERENCE, RUN = "model", "inference", "run"


def setting(
    default,
    help: str,
    kind: str = MODEL,
    choices=None,
    at_least=None,
    before_recorded=dataclasses.MISSING,
):
    """`before_recorded`: what checkpoints saved before the setting was recorded computed."""
    return dataclasses.field(
        default=default,
        metadata=dict(
            help=help,
            kind=kind,
            choices=choices,
            at_least=at_least,
            before_recorded=before_recorded,
        ),
    )


class VariantSettings:
    """The base of a variant's settings dataclass (frozen, every field a `setting`)."""

    prefix: ClassVar[str]

    def __init_subclass__(cls, prefix: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.prefix = prefix

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, rule = getattr(self, f.name), f.metadata
            if rule["choices"] is not None and value not in rule["choices"]:
                raise ValueError(f"{self.flag(f.name)} {value!r}: choose from {rule['choices']}")
            if rule["at_least"] is not None and value < rule["at_least"]:
                raise ValueError(
                    f"{self.flag(f.name)} {value}: must be at least {rule['at_least']}"
                )

    @classmethod
    def flag(cls, name: str) -> str:
        return f"--{cls.prefix}-{name.replace('_', '-')}"

    @classmethod
    def key(cls, name: str) -> str:
        """The setting's name in `model_args.json`, in the HF config and in parsed arguments."""
        return f"{cls.prefix}_{name}"

    @classmethod
    def names(cls, *kinds: str) -> List[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata["kind"] in kinds]

    @classmethod
    def add_flags(cls, group) -> None:
        for f in dataclasses.fields(cls):
            group.add_argument(
                cls.flag(f.name),
                type=type(f.default),
                default=f.default,
                choices=f.metadata["choices"],
                help=f.metadata["help"],
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return cls(
            **{name: getattr(args, cls.key(name)) for name in cls.names(MODEL, INFERENCE, RUN)}
        )

    @classmethod
    def from_model_args(cls, model_args: dict, **settings):
        """From a checkpoint's `model_args.json`, which holds the model settings; the others are
        taken from `settings` (None: the default)."""
        missing = [cls.key(name) for name in cls.names(MODEL) if cls.key(name) not in model_args]
        if missing:
            raise ValueError(
                f"model_args.json lacks {', '.join(missing)}: the {cls.prefix.capitalize()} "
                "checkpoint was saved by a megatron-focus that did not record them yet"
            )
        return cls(
            **{name: model_args[cls.key(name)] for name in cls.names(MODEL)},
            **{k: v for k, v in settings.items() if v is not None},
        )

    def keys(self, *kinds: str) -> dict:
        """{"<prefix>_<name>": value} of the settings of these kinds (default: the model's)."""
        return {self.key(name): getattr(self, name) for name in self.names(*(kinds or (MODEL,)))}

    def flags(self, *kinds: str) -> List[str]:
        return [
            str(x)
            for name in self.names(*(kinds or (MODEL, INFERENCE)))
            for x in (self.flag(name), getattr(self, name))
        ]

    @classmethod
    def before_recorded(cls) -> dict:
        """{"<prefix>_<name>": what checkpoints saved before a setting was recorded computed}."""
        return {
            cls.key(f.name): f.metadata["before_recorded"]
            for f in dataclasses.fields(cls)
            if f.metadata["before_recorded"] is not dataclasses.MISSING
        }
