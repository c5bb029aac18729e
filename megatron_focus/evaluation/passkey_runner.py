"""tools/eval_passkey.py's evaluation: a native checkpoint or an HF export asked for passkeys
(the task: passkey.py), by context length x depth, in each mode the model's variant evaluates
(Focus's soft gate and sparse rule at each --top-k)."""

import argparse
import json

import torch

from megatron_focus import platform
from megatron_focus.evaluation.passkey import greedy, keys, passkey_prompt, retrieved

ANSWER_TOKENS = 8  # enough for a five-digit number in any tokenizer here


class Native:
    """A checkpoint's native model (merged to one process) and its tokenizer."""

    def __init__(self, opts):
        from megatron_focus.checkpoint.native import (
            checkpoint_tag_dir,
            checkpoint_vocabulary,
            load_native_model,
        )
        from megatron_focus.variants import variant

        platform.init_distributed(1)
        tag_dir = checkpoint_tag_dir(opts.load, opts.iteration)
        self.vocab, self.tokenizer = checkpoint_vocabulary(tag_dir)
        if self.tokenizer is None:
            raise ValueError(
                f"{tag_dir} records no tokenizer (synthetic data or an "
                "import without one): passkey prompts are text"
            )
        model, self.model = load_native_model(
            tag_dir, self.vocab, allow_unsafe=opts.allow_unsafe_checkpoints
        )
        self.device = next(self.model.parameters()).device
        self.hooks = variant(model.attention).hooks_with(model.settings)
        self.positions = (
            model.max_position_embeddings
            if model.position_embedding_type == "learned_absolute"
            else None
        )

    def tokenize(self, text):
        return self.tokenizer.tokenize(text)

    def detokenize(self, ids):
        return self.tokenizer.detokenize(ids)

    def logits(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.model(tokens, positions, None)[..., : self.vocab]

    def modes(self, top_k):
        return self.hooks.evaluated_modes(top_k)

    def set_mode(self, mode):
        self.hooks.set_mode(self.model, mode)


class HF:
    """An exported model and its tokenizer, through transformers."""

    def __init__(self, opts):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            opts.hf, trust_remote_code=opts.trust_remote_code
        )
        self.device = "cuda" if platform.has_cuda() else "cpu"
        self.model = (
            AutoModelForCausalLM.from_pretrained(opts.hf, trust_remote_code=opts.trust_remote_code)
            .to(self.device)
            .eval()
        )
        config = self.model.config
        learned = (
            getattr(config, "position_embedding_type", None) == "learned_absolute"
            or config.model_type == "gpt2"
        )
        self.positions = config.max_position_embeddings if learned else None

    def tokenize(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids):
        return self.tokenizer.decode(ids)

    def logits(self, tokens):
        return self.model(tokens, use_cache=False).logits

    def modes(self, top_k):
        """The modes of the native variant of the export's layers (its hooks', from the
        settings its config records); the exported model switches them itself."""
        from megatron_focus.variants import VARIANTS

        config = self.model.config
        for kind in dict.fromkeys(getattr(config, "layer_attention", None) or []):
            attention = VARIANTS.get(kind)
            if attention is not None and attention.settings is not None:
                settings = attention.settings.from_model_args(config.to_dict())
                modes = attention.hooks_with(settings).evaluated_modes(top_k)
                if modes:
                    return modes
        return ()

    def set_mode(self, mode):
        self.model.set_focus_mode(mode.mode, mode.top_k)


def run(opts: argparse.Namespace) -> None:
    """The accuracy table for the tool's flags `opts`."""
    model = Native(opts) if opts.load else HF(opts)
    too_long = [
        n
        for n in opts.lengths
        if model.positions is not None and n + ANSWER_TOKENS > model.positions
    ]
    if too_long:
        raise ValueError(
            f"--lengths {' '.join(map(str, too_long))}: with the answer they "
            f"pass the model's learned position table ({model.positions})"
        )
    settings = [(m.mode, m.top_k, m) for m in model.modes(opts.top_k)] or [(None, None, None)]
    passkeys = keys(opts.trials, opts.seed)
    try:  # every prompt before any compute
        prompts = {
            (n, d): [passkey_prompt(model.tokenize, n, d, key) for key in passkeys]
            for n in opts.lengths
            for d in opts.depths
        }
    except ValueError as e:
        raise ValueError(f"--lengths: {e}") from None
    rows = []
    for mode, top_k, chosen in settings:
        if chosen is not None:
            model.set_mode(chosen)
        for (n, depth), batch in prompts.items():
            answers = [
                model.detokenize(greedy(model.logits, prompt, ANSWER_TOKENS, model.device))
                for prompt in batch
            ]
            hits = [retrieved(answer, key) for answer, key in zip(answers, passkeys)]
            rows.append(
                {
                    "mode": mode,
                    "top_k": top_k,
                    "length": n,
                    "depth": depth,
                    "accuracy": sum(hits) / len(hits),
                    "answers": answers,
                }
            )

    print(
        f"{opts.load or opts.hf}: passkey retrieval, {opts.trials} keys per cell "
        "(rows: depth; columns: length in tokens)"
    )
    for mode, top_k, _ in settings:
        if mode is not None:
            print(f"{mode}" + (f" top-{top_k}" if top_k else ""))
        print(f"{'depth':>7}" + "".join(f"{n:>8}" for n in opts.lengths))
        for depth in opts.depths:
            cells = [
                r["accuracy"]
                for r in rows
                if (r["mode"], r["top_k"], r["depth"]) == (mode, top_k, depth)
            ]
            print(f"{depth:>7.2f}" + "".join(f"{a:>8.2f}" for a in cells))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {"model": opts.load or opts.hf, "passkeys": passkeys, "rows": rows}, f, indent=2
            )
