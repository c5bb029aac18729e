"""The attention variants, by their `--attention` name, and Focus's settings.

Everything that asks "which core attention? which settings? does it apply XSA?" asks the
`AttentionVariant` registered under the run's `--attention` name. The module imports nothing heavy
(`pretrain_gpt.py --help` reads it): a variant names its core and self-attention classes by import
path, imported when a model is built, and its settings class (settings.py) by the class itself.

A new variant is a module of its own (its `CoreAttention` subclass, and its settings if it has
any) and one `register(...)` call; docs/extending.md walks through them. Modules named in the
environment variable `MEGATRON_FOCUS_VARIANTS` (comma-separated) are imported with this one, so a
variant registered outside the package is known to `pretrain_gpt.py`, the tools and every launched
rank alike.
"""

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Dict, List, Optional, Tuple, Type

from megatron_focus.settings import INFERENCE, MODEL, RUN, VariantSettings, setting

FOCUS_GATES = ("log", "sigmoid")  # the soft gate on distant pairs: model/focus/focus_gate.py
# the soft gate's kernel: model/kernels/kernels.py
FOCUS_KERNELS = ("auto", "triton", "flex", "chunked")
FOCUS_MODES = ("soft", "sparse")  # the soft gate (training) or the hard top-k rule
# the router trained, or controls that never learn: W_g and the centroids frozen at their draw
# from the seed, or the centroids alone (docs/routing.md)
FOCUS_ROUTERS = ("learned", "random", "random-centroids")


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """What the framework needs to know of an attention variant.

    `core_attention`: "package.module:Class", a `model.core_attention.CoreAttention` subclass;
    its `spec(settings)` says how a layer builds it. `settings`: the variant's settings class (a
    `VariantSettings` dataclass), or None: its flags, the keys its checkpoints record and its
    parameters per layer. `self_attention`: "package.module:Class" of the layer's attention
    module (Megatron's `SelfAttention`, or a subclass handing the core attention more inputs).
    `xsa`: XSA on the output; `--xsa-layers` may keep it to some layers, the others then use
    `without_xsa`. `without_focus`: the variant without routers, a retrofit's start.
    `hf_attention`: the HF model's layer kind that computes the same (None: no HF export).
    `hf_layer`: "module:Class" of the HF model's layer the variant ships instead (an
    `Attention` subclass of `hf/modeling_megatron_focus.py`, in a file needing only torch and
    transformers), exported with its file as the layer kind of the variant's name, its settings
    in `config.json` under their recorded keys. `hooks`: "package.module:Class" of what the
    variant adds to a run beyond its layers (a `model.hooks.VariantHooks`: frozen parameters,
    other validation modes, statistics). `renamed`: (old, new) parts of its weights' names that
    earlier versions saved under the old, so that their checkpoints load (`current_name`).
    """

    name: str
    core_attention: str
    settings: Optional[Type[VariantSettings]] = None
    self_attention: str = "megatron.core.transformer.attention:SelfAttention"
    xsa: bool = False
    without_xsa: Optional[str] = None
    without_focus: Optional[str] = None
    hf_attention: Optional[str] = None
    hooks: str = "megatron_focus.model.hooks:VariantHooks"
    hf_layer: Optional[str] = None
    renamed: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.hf_layer is not None and self.hf_attention is not None:
            raise ValueError(
                f"attention variant {self.name!r}: hf_attention names a layer of the HF model, "
                "hf_layer ships one of its own; give one of them"
            )

    @property
    def focus(self) -> bool:
        """The layer routes (Focus's router, soft and sparse modes, `--retrofit`): its settings
        are Focus's."""
        return self.settings is not None and issubclass(self.settings, FocusConfig)

    def core_attention_class(self) -> type:
        return _load(self.core_attention)

    def self_attention_class(self) -> type:
        return _load(self.self_attention)

    @property
    def hf_kind(self) -> Optional[str]:
        """What the exported `config.json` calls the variant's layers (None: no HF export)."""
        return self.name if self.hf_layer is not None else self.hf_attention

    def hf_layer_class(self) -> type:
        return _load(self.hf_layer)

    def settings_from(self, args: argparse.Namespace) -> Optional[VariantSettings]:
        """The variant's settings as the run's flags give them (None: it has none)."""
        return None if self.settings is None else self.settings.from_args(args)

    def hooks_for(self, args: argparse.Namespace):
        """The variant's hooks for the run the flags describe."""
        return self.hooks_with(self.settings_from(args))

    def hooks_with(self, settings: Optional[VariantSettings]):
        """The variant's hooks for a model of these settings (an export's, say)."""
        return _load(self.hooks)(settings)

    def recorded_keys(self) -> Tuple[str, ...]:
        """The `model_args.json` keys of the variant's model settings (compared on load)."""
        return (
            ()
            if self.settings is None
            else tuple(map(self.settings.key, self.settings.names(MODEL)))
        )

    def before_recorded(self) -> dict:
        """What checkpoints saved before one of its settings was recorded computed."""
        return {} if self.settings is None else self.settings.before_recorded()

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


def added_weight(name: str) -> bool:
    """A weight a variant adds to a model of standard attention: its core attention's own (a
    variant creates its parameters there, docs/extending.md; standard attention has none). A
    start from a standard model's weights initialises these; a retrofit trains only these."""
    return ".self_attention.core_attention." in name and not name.endswith("_extra_state")


def current_name(name: str) -> str:
    """A weight's name in this version, from its name in a checkpoint of any version."""
    for v in VARIANTS.values():
        for old, new in v.renamed:
            name = name.replace(old, new)
    return name


def settings_classes() -> Dict[type, List[str]]:
    """Each settings class of the registered variants, with the names of its variants."""
    out: Dict[type, List[str]] = {}
    for v in VARIANTS.values():
        if v.settings is not None:
            out.setdefault(v.settings, []).append(v.name)
    return out


@dataclasses.dataclass(frozen=True)
class FocusConfig(VariantSettings, prefix="focus"):
    """Focus's settings: `--focus-<name>` flags, `focus_<name>` keys of `model_args.json` and of
    the HF config, all generated from these fields."""

    groups: int = setting(8, "K, groups per layer", at_least=1)
    dim: int = setting(16, "d_g, routing dimension", at_least=1)
    window: int = setting(128, "w, local window (keys)", at_least=1)
    tau: float = setting(0.1, "routing temperature (above 0)")
    sinkhorn_iters: int = setting(10, "Sinkhorn iterations of the causal balancing", at_least=0)
    gate_scale: float = setting(
        1.0, "lambda: distant pairs get lambda * log(g_i . g_j); 0 = gate open", at_least=0
    )
    gate: str = setting(
        "log",
        "the soft gate on distant pairs: log (ours, above) or sigmoid (the paper's "
        "logit * sigmoid(lambda g_i . g_j), for ablations; explicit scores per chunk on the CPU, "
        "slower)",
        choices=FOCUS_GATES,
        before_recorded="log",
    )
    sink_tokens: int = setting(
        0,
        "the first s tokens of every sequence (of every document, with "
        "--reset-attention-mask) are kept for every query, in both modes, as local pairs are "
        "(an attention sink)",
        at_least=0,
        before_recorded=0,
    )
    router: str = setting(
        "learned",
        "the routers learn, or a control that does not: random (W_g and the centroids frozen "
        "as drawn from --seed) or random-centroids (the centroids frozen, W_g learned)",
        choices=FOCUS_ROUTERS,
        before_recorded="learned",
    )
    top_k: int = setting(2, "groups per query, sparse mode", INFERENCE)
    attention_mode: str = setting(
        "soft",
        "soft gate, or hard top-k rule computing only the kept pairs (sparse: inference, "
        "or training at a longer sequence with the routers frozen, as their groups are a hard "
        "choice; no attention dropout)",
        INFERENCE,
        choices=FOCUS_MODES,
    )
    chunk_size: int = setting(
        128, "queries per chunk of the soft-gate attention (memory ~ chunk x seq)", RUN, at_least=1
    )
    distill_coeff: float = setting(
        0.0,
        "weight of the routers' distillation loss: each query's assignment pulled toward the "
        "groups of the distant keys its dense attention attends to, KL(M_t || g_t); it trains "
        "the routers alone (their input and the attention detached), in every mode, sparse "
        "included (docs/routing.md); 0: off",
        RUN,
        at_least=0,
    )
    dense_warmup_iters: int = setting(
        0,
        "iterations from the run's start (a resume keeps its checkpoint's) in which Focus's "
        "layers attend densely, as standard attention, the routers learning only by "
        "distillation; then --focus-attention-mode's rule",
        RUN,
        at_least=0,
    )
    kernel: str = setting(
        "auto",
        "soft gate's kernel: triton (fused Triton kernel), flex (FlexAttention score_mod) or "
        "chunked; auto = triton on a GPU (flex without Triton), chunked on the CPU",
        RUN,
        choices=FOCUS_KERNELS,
    )

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.groups:
            raise ValueError(
                f"{self.flag('top_k')} {self.top_k} must be between 1 and "
                f"{self.flag('groups')} {self.groups}"
            )
        if self.tau <= 0:
            raise ValueError(f"{self.flag('tau')} {self.tau}: must be above 0")
        if self.distill_coeff > 0 and self.router == "random":
            raise ValueError(
                f"{self.flag('distill_coeff')} {self.distill_coeff} trains the routers, which "
                f"{self.flag('router')} random keeps frozen: drop one of them"
            )
        if self.dense_warmup_iters and not self.distill_coeff:
            raise ValueError(
                f"{self.flag('dense_warmup_iters')} {self.dense_warmup_iters}: the routers learn "
                f"nothing while the layers attend densely but by distillation: give "
                f"{self.flag('distill_coeff')} (e.g. 1)"
            )


FOCUS_SELF_ATTENTION = "megatron_focus.model.focus.focus:FocusSelfAttention"
FOCUS_HOOKS = "megatron_focus.model.focus.focus:FocusHooks"
# Checkpoints of earlier versions hold each router beside its core attention; it now lives inside.
FOCUS_RENAMED = ((".self_attention.router.", ".self_attention.core_attention.router."),)
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
        "megatron_focus.model.focus.focus:FocusAttention",
        settings=FocusConfig,
        self_attention=FOCUS_SELF_ATTENTION,
        without_focus="standard",
        hf_attention="focus",
        hooks=FOCUS_HOOKS,
        renamed=FOCUS_RENAMED,
    )
)
register(
    AttentionVariant(
        "focus+xsa",
        "megatron_focus.model.focus.focus:FocusXSAAttention",
        settings=FocusConfig,
        self_attention=FOCUS_SELF_ATTENTION,
        xsa=True,
        without_xsa="focus",
        without_focus="xsa",
        hf_attention="focus+xsa",
        hooks=FOCUS_HOOKS,
        renamed=FOCUS_RENAMED,
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
