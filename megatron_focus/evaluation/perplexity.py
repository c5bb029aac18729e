"""tools/eval_ppl.py's evaluation: perplexity at each context length, in each mode the model's
variant evaluates (its hooks' `evaluated_modes`: Focus's soft gate and sparse rule at each top-k),
with the share of causal pairs kept, the share of the dense attention's mass they hold (sparse
modes), and the time per token: of the whole forward and of the attention inside it."""

import argparse
import contextlib
import json
import math
import time

import torch
import torch.nn.functional as F

from megatron_focus import platform
from megatron_focus.checkpoint.native import (
    checkpoint_tag_dir,
    native_model,
    read_weights,
    recorded_model,
)
from megatron_focus.config.validation import validate_args
from megatron_focus.data.loader import micro_batches, to_device
from megatron_focus.data.sources import datasets_for, tokenizer_for
from megatron_focus.model.hooks import EvalMode, VariantHooks
from megatron_focus.model.kernels.kernels import chosen
from megatron_focus.variants import variant


class AttentionTimer:
    """Wall time spent inside the core attention modules (each attention layer's
    `core_attention`, whatever its variant; forward only, device-synchronised)."""

    def __init__(self, model):
        self.seconds, self._start = 0.0, None
        cores = {
            id(m.core_attention): m.core_attention
            for m in model.modules()
            if isinstance(getattr(m, "core_attention", None), torch.nn.Module)
        }
        self.modules = len(cores)
        for module in cores.values():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _sync(self):
        if platform.has_cuda():
            torch.cuda.synchronize()

    def _enter(self, *_):
        self._sync()
        self._start = time.perf_counter()

    def _exit(self, *_):
        self._sync()
        self.seconds += time.perf_counter() - self._start


@torch.no_grad()
def evaluate(
    model, batches, timer: AttentionTimer, hooks: VariantHooks, sparse: bool, vocab_size: int
) -> dict:
    """Mean loss over the loss-mask tokens (the trainer's, per micro-batch); accuracy, the share
    of those tokens predicted by the argmax (MQAR: recalled values); pairs kept by a `sparse`
    mode's rule (a dense mode computes all of them); the time per token of the model's forward
    (embedding to logits, device-synchronised; not the loss) and of the attention modules inside.

    One untimed forward on the first micro-batch comes first, so that one-time costs (kernel
    compilation, the allocator's first blocks) are charged to no mode. In a sparse mode it also
    measures each layer's kept mass (routing_quality) on every query of that micro-batch: its
    dense scores, O(n^2) a layer, stay out of the timed forwards."""
    device = next(model.parameters()).device
    first = to_device(batches[0], device)
    with hooks.recording(model, sample="all") if sparse else contextlib.nullcontext():
        model(first["tokens"], first["position_ids"], None)  # the warm-up
    mass = {
        name.split("/")[1]: float(value)
        for name, value in hooks.statistics(model).items()
        if sparse and name.endswith("kept-mass")
    }
    timer.seconds, total, hits, counted, kept = 0.0, 0.0, 0.0, 0.0, []
    forward_s, tokens = 0.0, 0
    start = time.perf_counter()
    for batch in batches:
        batch = to_device(batch, device)
        with hooks.recording(model, sample=0):
            timer._sync()
            began = time.perf_counter()
            logits = model(batch["tokens"], batch["position_ids"], None)[..., :vocab_size]
            timer._sync()
            forward_s += time.perf_counter() - began
        tokens += batch["tokens"].numel()
        mask = batch["loss_mask"].float()
        per_token = F.cross_entropy(
            logits.float().transpose(1, 2), batch["labels"], reduction="none"
        )
        total += float((per_token * mask).sum() / mask.sum().clamp(min=1))
        hits += float(((logits.argmax(-1) == batch["labels"]).float() * mask).sum())
        counted += float(mask.sum())
        kept += [float(v) for k, v in hooks.statistics(model).items() if k.endswith("pairs-kept")]
    loss = total / len(batches)
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 30.0)),
        "accuracy": hits / max(counted, 1),
        "pairs_kept": sum(kept) / len(kept) if sparse else 1.0,
        "kept_mass": sum(mass.values()) / len(mass) if mass else None,
        "kept_mass_layers": mass or None,
        "tokens": tokens,
        "forward_ms": forward_s * 1e3,
        "us_per_token": forward_s * 1e6 / tokens,
        "attention_ms": timer.seconds * 1e3,
        "attention_us_per_token": timer.seconds * 1e6 / tokens,
        "total_ms": (time.perf_counter() - start) * 1e3,
    }


def run(opts: argparse.Namespace, args: argparse.Namespace) -> None:
    """The table for `opts` (the tool's own flags) and `args` (pretrain_gpt.py's data and
    evaluation flags, as parsed: validated at each length)."""
    platform.init_distributed(1)
    tag_dir = checkpoint_tag_dir(opts.load, opts.iteration)
    tokenizer = tokenizer_for(args, rank0=True)
    recorded = recorded_model(tag_dir)  # the checkpoint's model, as model_args.json records it
    hooks = variant(recorded.attention).hooks_with(recorded.settings)
    modes = hooks.evaluated_modes()
    positions = (
        recorded.max_position_embeddings
        if recorded.position_embedding_type == "learned_absolute"
        else None
    )
    # without a length, the checkpoint's: its position count, which a run sets to its
    # --seq-length unless given (capped at a learned position table)
    default = args.seq_length or recorded.max_position_embeddings
    lengths = opts.seq_lengths or [min(default, positions or default)]
    too_long = [n for n in lengths if positions is not None and n > positions]
    if too_long:
        raise ValueError(
            f"--seq-lengths {' '.join(map(str, too_long))}: the model's "
            f"learned position table has {positions} positions (RoPE models "
            "evaluate at any length)"
        )
    batches = {}
    for n in lengths:  # every length's data before the model: bad data fails first
        at_length = {"seq_length": n, "max_position_embeddings": n}  # the model's: checked above
        config = validate_args(  # the data and evaluation flags
            argparse.Namespace(**{**vars(args), **at_length}), world_size=1, training=False
        )
        _, valid = datasets_for(config, tokenizer)
        if valid is None:
            raise ValueError("--split leaves no validation data, or --eval-iters is 0")
        micro_batch = config.training.micro_batch_size
        batches[n] = list(
            micro_batches(valid, 0, config.logging.eval_iters * micro_batch, micro_batch, 1, 0)
        )
    # The checkpoint's model, merged to one process whatever its TP size or ZeRO stage.
    model = native_model(
        recorded,
        tokenizer.vocab_size,
        read_weights(
            tag_dir,
            tokenizer.vocab_size,
            progress=False,
            allow_unsafe=config.checkpoint.allow_unsafe_checkpoints,
        ),
    )
    timer = AttentionTimer(model)

    rows = []
    for mode in modes or (EvalMode(recorded.attention),):  # none: the model as it is
        if modes:
            hooks.set_mode(model, mode)
        for n in lengths:
            row = evaluate(model, batches[n], timer, hooks, mode.sparse, tokenizer.vocab_size)
            if recorded.window_size is not None:  # a sliding window keeps its band
                row["pairs_kept"] = window_share(n, recorded.window_size[0])
            rows.append({"mode": mode.mode, "top_k": mode.top_k, "seq_length": n, **row})

    sequences = config.logging.eval_iters * config.training.micro_batch_size
    print(f"{opts.load}: {recorded.attention}, {sequences} validation sequences per length")
    kernels = chosen(model) or None  # the variant's kernels, where it chooses any
    if kernels:
        print("kernels: " + ", ".join(f"{op} {name}" for op, name in kernels.items()))
    print(table(rows, lengths))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {
                    "load": opts.load,
                    "attention": recorded.attention,
                    "sequences": sequences,
                    "seq_lengths": lengths,
                    "kernels": kernels,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    platform.destroy_distributed()


def window_share(n: int, left: int) -> float:
    """Causal pairs a sliding window (keys i - left .. i) keeps, of all n (n + 1) / 2."""
    return sum(min(i + 1, left + 1) for i in range(n)) / (n * (n + 1) / 2)


def table(rows: list, lengths: list) -> str:
    """One line per mode and top-k: at one length its loss, perplexity, accuracy, pairs kept, kept
    mass and the time per token of the forward and of its attention (microseconds); at several,
    the perplexity, accuracy, pairs kept, kept mass and forward time per token at each length."""
    lines = []
    if len(lengths) == 1:
        lines.append(
            f"{'mode':<8}{'top-k':>6}{'loss':>9}{'ppl':>10}{'accuracy':>10}"
            f"{'pairs kept':>12}{'kept mass':>11}{'us/token':>10}{'attn us/token':>15}"
            f"   (seq {lengths[0]})"
        )
        for r in rows:
            lines.append(
                f"{r['mode']:<8}{r['top_k'] or '':>6}{r['loss']:>9.4f}{r['ppl']:>10.2f}"
                f"{r['accuracy']:>10.3f}{r['pairs_kept']:>12.3f}{_mass(r, 11)}"
                f"{r['us_per_token']:>10.2f}{r['attention_us_per_token']:>15.2f}"
            )
        note = TIMING_NOTE + "; attn us/token: its part in the attention modules"
        return "\n".join(lines + [MASS_NOTE, note])
    columns = (
        ("ppl", "ppl", ".2f"),
        ("acc", "accuracy", ".3f"),
        ("kept", "pairs_kept", ".3f"),
        ("mass", "kept_mass", None),
        ("us/tok", "us_per_token", ".2f"),
    )
    lines.append(
        f"{'mode':<8}{'top-k':>6}"
        + "".join(f"{f'{name}@{n}':>13}" for name, _, _ in columns for n in lengths)
    )
    for i in range(0, len(rows), len(lengths)):
        group = rows[i : i + len(lengths)]
        lines.append(
            f"{group[0]['mode']:<8}{group[0]['top_k'] or '':>6}"
            + "".join(
                _mass(r, 13) if fmt is None else f"{r[key]:>13{fmt}}"
                for _, key, fmt in columns
                for r in group
            )
        )
    return "\n".join(lines + [MASS_NOTE, TIMING_NOTE])


def _mass(row: dict, width: int) -> str:
    """The kept mass, or '-' where the rule keeps no subset (soft gate, other attentions)."""
    return f"{'-' if row['kept_mass'] is None else format(row['kept_mass'], '.3f'):>{width}}"


MASS_NOTE = (
    "kept mass: the share of the dense attention's probability mass the sparse rule keeps\n"
    "(mean over layers, heads and the queries beyond the window; every query of the first\n"
    "micro-batch)"
)


TIMING_NOTE = (
    "us/token: microseconds of the model's forward (embedding to logits) per token evaluated,\n"
    "after one untimed warm-up forward per row"
)
