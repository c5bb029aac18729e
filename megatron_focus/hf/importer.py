"""A Hugging Face model folder -> a native checkpoint that `pretrain_gpt.py --load` starts from.

Reads Llama, Mistral, Qwen2, GPT-2 and megatron_focus models (safetensors), refuses what the native
model cannot compute exactly (see `families.py`), and writes a weights-only checkpoint for the
requested tensor-parallel size, with the HF tokenizer copied next to it. `--attention xsa`
retrofits XSA onto a standard model: XSA has no parameters, so the weights are the same.

`--attention focus` (or `focus+xsa`) on a model without Focus is a Focus retrofit: the checkpoint
holds the base model (attention standard, or xsa), exactly as an import with `--attention standard`
(or `xsa`) writes it, and the returned flags are those of the retrofit run, `pretrain_gpt.py
--attention focus --retrofit --load CKPT`, whose weights-only load initialises the routers
(absent from the checkpoint) and trains only them. An exported Focus model (megatron_focus with
routers) imports with its routers and Focus settings.

A model whose layers an attention variant ships (its own layer kind in `layer_attention`) imports
as that variant, with the settings its HF config holds under their recorded keys, when the variant
is registered; it is refused by name when it is not.
"""

import dataclasses
import json
import os
from typing import Optional, Sequence

from megatron_focus.hf import families, native
from megatron_focus.hf.architecture import routing_settings, shipped_layers
from megatron_focus.hf.mapping import hf_to_native
from megatron_focus.hf.tokenizer import SPECIAL_TOKEN_IDS, find_hf_tokenizer
from megatron_focus.outputs import check_fresh
from megatron_focus.variants import VARIANTS, variant


def _hf_config(hf_dir: str):
    """The folder's config; ours is read with our own class, never with code from the folder."""
    from transformers import AutoConfig

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no such folder")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--hf-dir {hf_dir}: no config.json (a folder written by save_pretrained holds one)"
        )
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if model_type == MegatronFocusConfig.model_type:
        return MegatronFocusConfig.from_pretrained(hf_dir)
    return AutoConfig.from_pretrained(hf_dir)


def _hf_weights(hf_dir: str) -> dict:
    """Every tensor of the folder's safetensors files, in their stored dtype."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{hf_dir} has no model.safetensors(.index.json); save the model "
            "with save_pretrained (safetensors is its default) first"
        )
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(hf_dir, name)))
    return weights


def _special_token_ids(config, vocab_size: int) -> dict:
    """The config's bos/eos/pad ids that name a token of the vocabulary (GPT-2's config defaults
    name 50256 whatever the vocabulary)."""
    ids = {name: getattr(config, name, None) for name in SPECIAL_TOKEN_IDS}
    return {name: i for name, i in ids.items() if isinstance(i, int) and 0 <= i < vocab_size}


def import_from_hf(
    hf_dir: str,
    save_dir: str,
    tensor_model_parallel_size: int = 1,
    attention: Optional[str] = None,
    xsa_layers: Optional[Sequence[int]] = None,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
    overwrite: bool = False,
) -> list:
    """Write the native checkpoint; returns the `pretrain_gpt.py` model flags that load it.

    For a Focus retrofit (`attention` focus or focus+xsa, the HF model without Focus) they are the
    flags of the retrofit run, `--retrofit` included; add `--focus-*` settings to taste.
    """
    check_fresh(save_dir, overwrite)  # before any weight is read
    config = _hf_config(hf_dir)
    family, arch, biases = families.from_hf_config(config)
    retrofit = None
    if attention is not None and shipped_layers(arch) and attention != arch.attention:
        raise ValueError(
            f"the HF model's layers are --attention {arch.attention}'s own: importing it as "
            f"--attention {attention} would drop them; import it as {arch.attention}"
        )
    if attention is not None:
        routed = variant(attention).focus
        if routing_settings(arch) is not None and not routed:
            focus = " or ".join(v.name for v in VARIANTS.values() if v.focus)
            raise ValueError(
                f"the HF model has Focus routers: importing it as --attention "
                f"{attention} would drop them; import it as {focus}"
            )
        if routed and routing_settings(arch) is None:
            retrofit, attention = attention, variant(attention).without_focus
        target = variant(attention)
        keep = target.settings is not None and isinstance(arch.settings, target.settings)
        arch = dataclasses.replace(
            arch,
            attention=attention,
            xsa_layers=tuple(xsa_layers) if xsa_layers else None,
            # the HF model's settings where they are the variant's; else the variant's defaults
            settings=arch.settings if keep else target.settings and target.settings(),
        )
    arch.check_tensor_parallel(tensor_model_parallel_size)  # before any weight is read
    rules = families.rules(family, arch, biases)

    weights = _hf_weights(hf_dir)
    rules += families.shipped_layer_rules(arch, rules, hf_names=weights)
    if arch.tied:  # the output layer is the embedding; HF may store it a second time
        weights.pop("lm_head.weight", None)
    native_weights = hf_to_native(weights, rules, progress)
    dtype = native_weights["embedding.word_embeddings.weight"].dtype
    native_weights = {name: tensor.to(dtype) for name, tensor in native_weights.items()}

    tokenizer_type, tokenizer_file = find_hf_tokenizer(hf_dir)
    native.write_checkpoint(
        save_dir,
        arch,
        native_weights,
        tensor_model_parallel_size,
        make_vocab_size_divisible_by,
        tokenizer_type,
        tokenizer_file,
        _special_token_ids(config, arch.vocab_size),
        progress,
        overwrite,
    )
    flags = arch.flags()
    if retrofit is not None:
        flags[flags.index("--attention") + 1] = retrofit
        flags.append("--retrofit")
    return flags
