"""The attention variants, by their `--attention` name, and Focus's settings as one schema.

Everything that asks "is this Focus? does it apply XSA? which core attention?" asks the
`AttentionVariant` registered under the run's `--attention` name. The module imports nothing heavy
(`pretrain_gpt.py --help` reads it): a variant names its core attention by import path, imported
when a model is built.

A new variant is a `CoreAttention` subclass in a module of its own and one `register(...)` call;
docs/extending.md walks through one. Modules named in the environment variable
`MEGATRON_FOCUS_VARIANTS` (comma-separated) are imported with this one, so a variant registered
outside the package is known to `pretrain_gpt.py`, the tools and every launched rank alike.
"""

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Dict, List, Optional

FOCUS_GATES = ("log", "sigmoid")  # the soft gate on distant pairs: model/focus_gate.py
FOCUS_KERNELS = ("auto", "triton", "flex", "chunked")  # the soft gate's kernel: model/kernels.py
FOCUS_MODES = ("soft", "sparse")  # the soft gate (training) or the hard top-k rule


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """What the framework needs to know of an attention variant.

    `core_attention`: "package.module:Class", a `model.core_attention.CoreAttention` subclass
    taking (config, layer_number, attn_mask_type, ...) and, when `focus`, `focus=FocusConfig`.
    `focus`: the layer routes (Focus's router, `--focus-*` settings, soft and sparse modes,
    `--retrofit`). `xsa`: XSA on the output; `--xsa-layers` may keep it to some layers, the others
    then use `without_xsa`. `without_focus`: the variant without routers, a retrofit's start.
    `hf_attention`: the HF model's layer kind that computes the same (None: no HF export).
    """

    name: str
    core_attention: str
    focus: bool = False
    xsa: bool = False
    without_xsa: Optional[str] = None
    without_focus: Optional[str] = None
    hf_attention: Optional[str] = None

    def core_attention_class(self) -> type:
        module, _, cls = self.core_attention.partition(":")
        return getattr(importlib.import_module(module), cls)

    def on_layer(self, layer_number: int, xsa_layers) -> "AttentionVariant":
        """The variant of layer `layer_number` (1-based, as Megatron's): XSA only where listed."""
        if not self.xsa or xsa_layers is None or layer_number in xsa_layers:
            return self
        return variant(self.without_xsa)


VARIANTS: Dict[str, AttentionVariant] = {}


def register(new: AttentionVariant) -> AttentionVariant:
    if new.name in VARIANTS:
        raise ValueError(f"attention variant {new.name!r} is already registered")
    VARIANTS[new.name] = new
    return new


def variant(name: str) -> AttentionVariant:
    if name not in VARIANTS:
        raise ValueError(f"unknown --attention {name!r}; choose from {', '.join(VARIANTS)}")
    return VARIANTS[name]


register(
    AttentionVariant(
        "standard", "megatron_focus.model.core_attention:CoreAttention", hf_attention="standard"
    )
)
register(
    AttentionVariant(
        "xsa",
        "megatron_focus.model.xsa:XSAAttention",
        xsa=True,
        without_xsa="standard",
        hf_attention="xsa",
    )
)
register(
    AttentionVariant(
        "focus",
        "megatron_focus.model.focus:FocusAttention",
        focus=True,
        without_focus="standard",
        hf_attention="focus",
    )
)
register(
    AttentionVariant(
        "focus+xsa",
        "megatron_focus.model.focus:FocusXSAAttention",
        focus=True,
        xsa=True,
        without_xsa="focus",
        without_focus="xsa",
        hf_attention="focus+xsa",
    )
)

PLUGINS = "MEGATRON_FOCUS_VARIANTS"
for _module in filter(None, (m.strip() for m in os.environ.get(PLUGINS, "").split(","))):
    try:
        importlib.import_module(_module)
    except ImportError as error:  # a setting of the environment: one line, before anything runs
        print(
            f"error: {PLUGINS} names {_module!r}, which cannot be imported: {error}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None

# What a setting is to the rest of the framework: part of what the model computes (recorded in
# model_args.json, compared on load, exported), an inference setting (free to change, exported as
# the HF model's default), or a kernel setting of this run only.
MODEL, INFERENCE, RUN = "model", "inference", "run"


def _setting(
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


@dataclasses.dataclass(frozen=True)
class FocusConfig:
    """Focus's settings: `--focus-<name>` flags, `focus_<name>` keys of `model_args.json` and of
    the HF config, all generated from these fields."""

    groups: int = _setting(8, "K, groups per layer", at_least=1)
    dim: int = _setting(16, "d_g, routing dimension", at_least=1)
    window: int = _setting(128, "w, local window (keys)", at_least=1)
    tau: float = _setting(0.1, "routing temperature (above 0)")
    sinkhorn_iters: int = _setting(10, "Sinkhorn iterations of the causal balancing", at_least=0)
    gate_scale: float = _setting(
        1.0, "lambda: distant pairs get lambda * log(g_i . g_j); 0 = gate open", at_least=0
    )
    gate: str = _setting(
        "log",
        "the soft gate on distant pairs: log (ours, above) or sigmoid (the paper's "
        "logit * sigmoid(lambda g_i . g_j), for ablations; explicit scores per chunk on the CPU, "
        "slower)",
        choices=FOCUS_GATES,
        before_recorded="log",
    )
    sink_tokens: int = _setting(
        0,
        "the first s tokens of every sequence (of every document, with "
        "--reset-attention-mask) are kept for every query, in both modes, as local pairs are "
        "(an attention sink)",
        at_least=0,
        before_recorded=0,
    )
    top_k: int = _setting(2, "groups per query, sparse mode", INFERENCE)
    attention_mode: str = _setting(
        "soft",
        "soft gate (training) or hard top-k rule (sparse inference)",
        INFERENCE,
        choices=FOCUS_MODES,
    )
    chunk_size: int = _setting(
        128, "queries per chunk of the soft-gate attention (memory ~ chunk x seq)", RUN, at_least=1
    )
    kernel: str = _setting(
        "auto",
        "soft gate's kernel: triton (fused Triton kernel), flex (FlexAttention score_mod) or "
        "chunked; auto = triton on a GPU (flex without Triton), chunked on the CPU",
        RUN,
        choices=FOCUS_KERNELS,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, rule = getattr(self, f.name), f.metadata
            if rule["choices"] is not None and value not in rule["choices"]:
                raise ValueError(f"{flag(f.name)} {value!r}: choose from {rule['choices']}")
            if rule["at_least"] is not None and value < rule["at_least"]:
                raise ValueError(f"{flag(f.name)} {value}: must be at least {rule['at_least']}")
        if not 1 <= self.top_k <= self.groups:
            raise ValueError(
                f"{flag('top_k')} {self.top_k} must be between 1 and {flag('groups')} {self.groups}"
            )
        if self.tau <= 0:
            raise ValueError(f"{flag('tau')} {self.tau}: must be above 0")

    @staticmethod
    def names(*kinds: str) -> List[str]:
        return [f.name for f in dataclasses.fields(FocusConfig) if f.metadata["kind"] in kinds]

    @staticmethod
    def add_flags(group) -> None:
        for f in dataclasses.fields(FocusConfig):
            group.add_argument(
                flag(f.name),
                type=type(f.default),
                default=f.default,
                choices=f.metadata["choices"],
                help=f.metadata["help"],
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FocusConfig":
        return cls(
            **{name: getattr(args, f"focus_{name}") for name in cls.names(MODEL, INFERENCE, RUN)}
        )

    @classmethod
    def from_model_args(cls, model_args: dict, **settings) -> "FocusConfig":
        """From a checkpoint's `model_args.json`, which holds the model settings; the others are
        taken from `settings` (None: the default)."""
        missing = [
            f"focus_{name}" for name in cls.names(MODEL) if f"focus_{name}" not in model_args
        ]
        if missing:
            raise ValueError(
                f"model_args.json lacks {', '.join(missing)}: the Focus checkpoint "
                "was saved by a megatron-focus that did not record them yet"
            )
        return cls(
            **{name: model_args[f"focus_{name}"] for name in cls.names(MODEL)},
            **{k: v for k, v in settings.items() if v is not None},
        )

    def keys(self, *kinds: str) -> dict:
        """{"focus_<name>": value} of the settings of these kinds (default: the model's)."""
        return {f"focus_{name}": getattr(self, name) for name in self.names(*(kinds or (MODEL,)))}

    def flags(self, *kinds: str) -> List[str]:
        return [
            str(x)
            for name in self.names(*(kinds or (MODEL, INFERENCE)))
            for x in (flag(name), getattr(self, name))
        ]

    @staticmethod
    def before_recorded() -> dict:
        """{"focus_<name>": what Focus checkpoints saved before a setting was recorded computed}."""
        return {
            f"focus_{f.name}": f.metadata["before_recorded"]
            for f in dataclasses.fields(FocusConfig)
            if f.metadata["before_recorded"] is not dataclasses.MISSING
        }

    def router_params(self, hidden_size: int) -> int:
        """W_g (hidden -> d_g) and the K centroids of one layer's router."""
        return hidden_size * self.dim + self.groups * self.dim


def flag(name: str) -> str:
    return f"--focus-{name.replace('_', '-')}"
