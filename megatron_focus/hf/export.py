"""A native checkpoint -> a Hugging Face model folder.

Writes `config.json`, the weights as safetensors (sharded above `max_shard_size`),
`generation_config.json` and the tokenizer; for the custom class also its code, with `auto_map`,
so `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads it. The model
class is chosen, and the tokenizer checked, before any weight is read.

An attention variant that ships its HF layer (`AttentionVariant.hf_layer`) has its layer's file
copied beside the model's code, and `modeling_megatron_focus_variants.py` written, which
registers each such layer under its kind and is what `auto_map` names: the folder loads in a
process that knows nothing of the variant.
"""

import json
import os
import shutil
import sys
from typing import Dict, Optional, Tuple

import torch

from megatron_focus.checkpoint.native import checkpoint_tag_dir, checkpoint_vocabulary, read_weights
from megatron_focus.hf import families, native
from megatron_focus.hf.architecture import shipped_layers
from megatron_focus.hf.mapping import native_to_hf
from megatron_focus.hf.tokenizer import (
    SPECIAL_TOKEN_IDS,
    mismatch_as_loaded,
    save_hf_tokenizer,
)
from megatron_focus.outputs import check_fresh, fresh_folder
from megatron_focus.variants import variant


def export_to_hf(
    load_dir: str,
    save_dir: str,
    iteration: Optional[int] = None,
    tokenizer_type: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    max_shard_size: str = "5GB",
    progress: bool = True,
    focus_top_k: Optional[int] = None,
    focus_attention_mode: Optional[str] = None,
    allow_unsafe: bool = False,
    overwrite: bool = False,
) -> str:
    """Export the checkpoint (latest, or `iteration`) of `load_dir`; returns the HF class name.

    A Focus model's top-k and mode (inference settings, not in the checkpoint) go into the HF
    config as given, else as `pretrain_gpt.py`'s defaults (2, soft); both can be changed on the
    loaded model (`model.config.focus_attention_mode = "sparse"`). The folder is written whole
    or not at all; one that holds files is replaced only with `overwrite`.
    """
    check_fresh(save_dir, overwrite)
    tag_dir = checkpoint_tag_dir(load_dir, iteration)
    vocab_size, tokenizer = checkpoint_vocabulary(tag_dir, tokenizer_type, tokenizer_model)
    arch = native.read_architecture(
        tag_dir, vocab_size, focus_top_k=focus_top_k, focus_attention_mode=focus_attention_mode
    )
    family, why = families.choose_family(arch)
    layers = _shipped_layers(shipped_layers(arch))

    with fresh_folder(save_dir, overwrite) as partial:
        if tokenizer is not None:
            special_tokens = save_hf_tokenizer(tokenizer, partial, arch.max_position_embeddings)
        else:  # e.g. an imported model without a tokenizer: the ids its HF config had. None is
            # written too: a stock config's defaults (GPT-2's 50256) lie outside a small vocabulary.
            special_tokens = {
                **dict.fromkeys(SPECIAL_TOKEN_IDS),
                **native.recorded_special_tokens(tag_dir),
            }
        config = families.hf_config(family, arch, special_tokens)
        if tokenizer is not None:
            family, why, config = _family_loading_the_tokenizer(
                family, why, config, arch, special_tokens, tokenizer, partial
            )
        if progress:
            print(f"{tag_dir} -> {families.HF_CLASS[family]}: {why}", flush=True)
        rules = families.rules(family, arch, families.HFBiases.of(arch))
        native_weights = read_weights(tag_dir, arch.vocab_size, progress, allow_unsafe)
        rules += families.shipped_layer_rules(arch, rules, native_names=native_weights)
        weights = native_to_hf(native_weights, rules, progress)
        del native_weights
        model = _model_holding(family, config, weights, {k: c for k, (c, _) in layers.items()})
        model.save_pretrained(partial, max_shard_size=max_shard_size)
        _write_rope_for_transformers4(os.path.join(partial, "config.json"))
        if family == families.CUSTOM:  # the decoder alone: what vLLM's Transformers backend builds
            _add_auto_map(partial, AutoModel=f"{MODEL_CODE[1]}.MegatronFocusModel")
        _ship_layers(partial, layers)
        _write_model_card(partial, save_dir, family, arch, tag_dir, tokenizer is not None)
    return families.HF_CLASS[family]


def _write_model_card(folder, save_dir, family, arch, tag_dir: str, has_tokenizer: bool) -> None:
    """The folder's README.md: what it is and how it loads. A custom class's folder needs
    `trust_remote_code=True` for its tokenizer too: transformers 5's `AutoTokenizer` reads the
    model's config first, which is this folder's own code, and without the flag asks on the
    terminal whether to run it."""
    custom = family == families.CUSTOM
    flag = ", trust_remote_code=True" if custom else ""
    name = os.path.basename(os.path.normpath(save_dir))
    lines = [
        "---",
        "library_name: transformers",
        "tags: [megatron-focus]",
        "---",
        "",
        f"# {families.HF_CLASS[family]} exported by megatron-focus",
        "",
        f"Attention: `{arch.attention}`, {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_attention_heads} heads; from checkpoint `{os.path.basename(tag_dir)}`.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}"{flag})',
    ]
    if has_tokenizer:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{name}"{flag})')
    lines.append("```")
    if custom:
        lines += [
            "",
            "The model's code is in this folder (`modeling_megatron_focus.py`; it needs only torch "
            "and transformers): both calls take `trust_remote_code=True`, the tokenizer's too "
            "(`AutoTokenizer` reads the model's config, which is that code).",
        ]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _family_loading_the_tokenizer(family, why, config, arch, special_tokens, tokenizer, folder):
    """`(family, why, config)`: the chosen family if `AutoTokenizer` loads the written tokenizer
    beside it as training encoded, else the custom class, whose folder's tokenizer is taken as
    written; refused by name if neither encodes as training did.

    Under transformers 4 a Qwen2 folder's own tokenizer is checked, but transformers 5 would load
    `Qwen2Tokenizer` instead, which 4.x lacks: such an export takes the custom class."""
    from transformers import __version__

    mismatch = mismatch_as_loaded(tokenizer, folder, config)
    if mismatch is None and family == families.QWEN2 and int(__version__.split(".")[0]) < 5:
        mismatch = "transformers 5 loads Qwen2Tokenizer, which transformers 4 cannot check"
    if mismatch is not None and family != families.CUSTOM:
        why = (
            f"not a stock {families.HF_CLASS[family]} (with it, {mismatch}): "
            "needs trust_remote_code=True"
        )
        family = families.CUSTOM
        config = families.hf_config(family, arch, special_tokens)
        mismatch = mismatch_as_loaded(tokenizer, folder, config)
    if mismatch is not None:
        raise ValueError(f"the exported tokenizer of {tokenizer.path}: {mismatch}; not exported")
    return family, why, config


def _write_rope_for_transformers4(config_path: str) -> None:
    """transformers 5 writes RoPE as `rope_parameters`, which 4.x does not read (it would run at
    its default base of 10000, unscaled): its own `rope_theta` and `rope_scaling` go beside it."""
    with open(config_path) as f:
        config = json.load(f)
    rope = config.get("rope_parameters")
    if rope is None:
        return
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# The folder's module registering the layers variants ship, and the files it may not replace
VARIANT_MODELING = "modeling_megatron_focus_variants"
MODEL_CODE = ("configuration_megatron_focus", "modeling_megatron_focus", VARIANT_MODELING)


def _shipped_layers(shipped: Dict[str, str]) -> Dict[str, Tuple[type, str]]:
    """{kind: (class, file)} of the HF layers the variants ship (`shipped`: {kind:
    "module:Class"}), each imported and its file checked before any weight is read. A layer's
    file imports the model's code relatively (in the folder; absolutely in the package) and
    nothing else of the folder: transformers copies a remote-code module's relative imports,
    and 4.x only those that the module `auto_map` names imports itself."""
    from transformers.dynamic_module_utils import get_relative_imports

    out = {}
    for kind, layer in shipped.items():
        cls = variant(kind).hf_layer_class()
        source = sys.modules[cls.__module__].__file__
        name = families.shipped_file(layer)[0]  # as the config's variant_layers says
        if os.path.basename(source) != f"{name}.py":
            raise ValueError(
                f"--attention {kind}: its HF layer {layer} is not in a module file of its own "
                f"({source})"
            )
        if name in MODEL_CODE:
            raise ValueError(
                f"--attention {kind}: its HF layer's file {source} takes the name of the HF "
                "model's own code; rename it"
            )
        others = sorted(set(get_relative_imports(source)) - set(MODEL_CODE))
        if others:
            raise ValueError(
                f"--attention {kind}: its HF layer's file {source} imports "
                f".{', .'.join(others)}, which the exported folder would not hold; keep the "
                "layer in one file"
            )
        out[kind] = cls, source
    files = {}
    for _, source in out.values():  # the folder holds each under its file name
        if files.setdefault(os.path.basename(source), source) != source:
            raise ValueError(
                f"the HF layers of two variants are in files of one name, "
                f"{files[os.path.basename(source)]} and {source}; rename one"
            )
    return out


def _ship_layers(folder: str, layers: Dict[str, Tuple[type, str]]) -> None:
    """Copy the file of each layer of `layers` ({kind: (class, file)}) into `folder`, write the
    module registering them and name it in `config.json`'s `auto_map`."""
    if not layers:
        return
    lines = [
        f"from .{MODEL_CODE[0]} import MegatronFocusConfig",
        f"from .{MODEL_CODE[1]} import ATTENTION",
        f"from .{MODEL_CODE[1]} import MegatronFocusForCausalLM as _MegatronFocusForCausalLM",
        f"from .{MODEL_CODE[1]} import MegatronFocusModel as _MegatronFocusModel",
    ]
    registered = []
    for number, (kind, (cls, source)) in enumerate(layers.items()):
        name = os.path.splitext(os.path.basename(source))[0]
        shutil.copyfile(source, os.path.join(folder, f"{name}.py"))
        # each class under a name of its own: two files may name their classes alike
        lines.append(f"from .{name} import {cls.__name__} as _Layer{number}")
        registered.append(f"ATTENTION[{json.dumps(kind)}] = _Layer{number}")
    with open(os.path.join(folder, f"{VARIANT_MODELING}.py"), "w") as f:
        f.write(VARIANT_MODELING_CODE.format(code="\n".join(lines + [""] + registered)))
    _add_auto_map(
        folder,
        AutoModelForCausalLM=f"{VARIANT_MODELING}.MegatronFocusForCausalLM",
        AutoModel=f"{VARIANT_MODELING}.MegatronFocusModel",
    )


def _add_auto_map(folder: str, **classes) -> None:
    """Name these auto classes' code in the folder's `config.json` (`auto_map`)."""
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["auto_map"].update(classes)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


VARIANT_MODELING_CODE = '''"""The megatron-focus HF model with the layers its attention variants
ship beside its code (`variant_layers` in config.json), each registered under its layer kind.
Written by tools/convert_to_hf.py."""

{code}


class MegatronFocusForCausalLM(_MegatronFocusForCausalLM):
    """The model, building the layer kinds registered here too (saved again, it keeps them)."""


class MegatronFocusModel(_MegatronFocusModel):
    """The decoder alone (AutoModel, which serving engines build), with those layer kinds."""


__all__ = ["MegatronFocusConfig", "MegatronFocusForCausalLM", "MegatronFocusModel"]
'''


def _model_holding(family: str, config, weights: dict, layers: Dict[str, type]):
    """The HF model built around `weights` (no second copy, no random initialisation), the
    variants' own `layers` ({kind: class}) registered with its layer kinds."""
    from transformers import (
        GenerationConfig,
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
    )

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import ATTENTION, MegatronFocusForCausalLM

    ATTENTION.update(layers)

    cls = {
        families.LLAMA: LlamaForCausalLM,
        families.QWEN2: Qwen2ForCausalLM,
        families.MISTRAL: MistralForCausalLM,
        families.GPT2: GPT2LMHeadModel,
        families.CUSTOM: MegatronFocusForCausalLM,
    }[family]
    if family == families.CUSTOM:  # save_pretrained then copies the code and writes auto_map
        MegatronFocusConfig.register_for_auto_class()
        MegatronFocusForCausalLM.register_for_auto_class("AutoModelForCausalLM")

    config.dtype = next(iter(weights.values())).dtype
    with torch.device("meta"):
        model = cls(config)
    result = model.load_state_dict(weights, strict=False, assign=True)
    # transformers 5: {tied: source}; 4.x: [tied]
    tied = set(model._tied_weights_keys or ()) if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(
            f"{cls.__name__} does not fit the mapped weights: missing "
            f"{result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig(
        **{k: getattr(config, k, None) for k in SPECIAL_TOKEN_IDS}
    )
    return model.eval()
