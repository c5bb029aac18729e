"""Perplexity of a checkpoint on the validation split, at one or several context lengths; for
Focus, the effect of top-k.

For a Focus model, one row for the soft gate (how it trained) and one per top-k = 1..K in sparse
mode (the hard rule, run by the sparse dispatch): loss, perplexity, the share of causal pairs kept
(mean over layers), and the time spent in attention — the paper's "effect of top-k" table,
measured on this model. Other models get one row. `--seq-lengths 1024 2048 4096 8192` repeats it
at each length (the paper's long-context table: PPL by length for each mode); RoPE models go
beyond their training length, models with learned positions up to their position table.

    python tools/eval_ppl.py --load CKPT [--data-path PREFIX --tokenizer-type T --tokenizer-model M]
        [--eval-iters 20 --micro-batch-size 4] [--seq-lengths 1024 4096] [--json out.json]

Without --data-path it reads the embedded corpus (the default of pretrain_gpt.py). The model is
rebuilt from the checkpoint's own settings and merged to one process, whatever its TP size.
Without --seq-lengths it evaluates at --seq-length (capped at a learned position table).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_focus import cli, platform  # noqa: E402
from megatron_focus.arguments import build_parser, validate_args  # noqa: E402
from megatron_focus.data.loader import micro_batches, to_device  # noqa: E402
from megatron_focus.data.sources import datasets_for, tokenizer_for  # noqa: E402
from megatron_focus.hf.native import (  # noqa: E402
    checkpoint_tag_dir,
    native_model,
    read_architecture,
    read_weights,
)
from megatron_focus.model.focus import (  # noqa: E402
    FocusAttention,
    focus_statistics,
    recording_statistics,
    set_focus_mode,
)
from megatron_focus.model.kernels import chosen  # noqa: E402


def parse() -> tuple[argparse.Namespace, argparse.Namespace]:
    p = cli.Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument(
        "--seq-lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="context lengths to evaluate at (default: --seq-length)",
    )
    p.add_argument("--json", metavar="PATH")
    opts, rest = p.parse_known_args()
    if opts.seq_lengths and min(opts.seq_lengths) < 2:
        p.error("--seq-lengths must be at least 2")
    args = build_parser().parse_args(rest)  # data and evaluation flags, as pretrain_gpt.py's;
    # the model comes from the checkpoint
    return opts, args


class AttentionTimer:
    """Wall time spent inside the Focus core attention modules (forward only)."""

    def __init__(self, model):
        self.seconds, self._start = 0.0, None
        for module in model.modules():
            if isinstance(module, FocusAttention):
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
def evaluate(model, batches, timer: AttentionTimer, sparse: bool, vocab_size: int) -> dict:
    """Mean loss over the loss-mask tokens (the trainer's, per micro-batch); accuracy, the share
    of those tokens predicted by the argmax (MQAR: recalled values); pairs kept by the hard rule
    (all pairs are computed in soft mode)."""
    timer.seconds, total, hits, counted, kept = 0.0, 0.0, 0.0, 0.0, []
    start = time.perf_counter()
    device = next(model.parameters()).device
    for batch in batches:
        batch = to_device(batch, device)
        with recording_statistics(model):
            logits = model(batch["tokens"], batch["position_ids"], None)[..., :vocab_size]
        mask = batch["loss_mask"].float()
        per_token = F.cross_entropy(
            logits.float().transpose(1, 2), batch["labels"], reduction="none"
        )
        total += float((per_token * mask).sum() / mask.sum().clamp(min=1))
        hits += float(((logits.argmax(-1) == batch["labels"]).float() * mask).sum())
        counted += float(mask.sum())
        kept += [float(v) for k, v in focus_statistics(model).items() if k.endswith("pairs-kept")]
    loss = total / len(batches)
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 30.0)),
        "accuracy": hits / max(counted, 1),
        "pairs_kept": sum(kept) / len(kept) if sparse else 1.0,
        "attention_ms": timer.seconds * 1e3,
        "total_ms": (time.perf_counter() - start) * 1e3,
    }


def main() -> None:
    opts, args = parse()
    platform.init_distributed(1)
    tag_dir = checkpoint_tag_dir(opts.load, opts.iteration)
    tokenizer = tokenizer_for(args, rank0=True)
    arch = read_architecture(tag_dir, tokenizer.vocab_size)
    positions = (
        arch.max_position_embeddings if arch.position_embedding_type == "learned_absolute" else None
    )
    lengths = opts.seq_lengths or [min(args.seq_length, positions or args.seq_length)]
    too_long = [n for n in lengths if positions is not None and n > positions]
    if too_long:
        raise ValueError(
            f"--seq-lengths {' '.join(map(str, too_long))}: the model's "
            f"learned position table has {positions} positions (RoPE models "
            "evaluate at any length)"
        )
    batches = {}
    for n in lengths:  # every length's data before the model: bad data fails first
        args.seq_length = args.max_position_embeddings = n  # the model's are checked above
        validate_args(args, world_size=1)  # the data and evaluation flags
        _, valid = datasets_for(args, tokenizer)
        if valid is None:
            raise ValueError("--split leaves no validation data, or --eval-iters is 0")
        batches[n] = list(
            micro_batches(
                valid, 0, args.eval_iters * args.micro_batch_size, args.micro_batch_size, 1, 0
            )
        )
    # The checkpoint's model, merged to one process whatever its TP size or ZeRO stage.
    model = native_model(
        arch,
        read_weights(tag_dir, arch, progress=False, allow_unsafe=args.allow_unsafe_checkpoints),
    )
    timer = AttentionTimer(model)

    rows = []
    if arch.focus is not None:
        settings = [("soft", None)] + [("sparse", k) for k in range(1, arch.focus.groups + 1)]
    else:
        settings = [(arch.attention, None)]
    for mode, top_k in settings:
        if arch.focus is not None:
            set_focus_mode(model, mode, top_k)
        for n in lengths:
            row = evaluate(model, batches[n], timer, mode == "sparse", tokenizer.vocab_size)
            if arch.window_size is not None:  # a sliding window keeps its band
                row["pairs_kept"] = window_share(n, arch.window_size[0])
            rows.append({"mode": mode, "top_k": top_k, "seq_length": n, **row})

    sequences = args.eval_iters * args.micro_batch_size
    print(f"{opts.load}: {arch.attention}, {sequences} validation sequences per length")
    kernels = None
    if arch.focus is not None:
        kernels = chosen(model)
        print("Focus kernels: " + ", ".join(f"{op} {name}" for op, name in kernels.items()))
    print(table(rows, lengths))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {
                    "load": opts.load,
                    "attention": arch.attention,
                    "sequences": sequences,
                    "seq_lengths": lengths,
                    "focus_kernels": kernels,
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
    """One line per mode and top-k: at one length its loss, perplexity, accuracy, pairs kept and
    attention time; at several, the perplexity, accuracy and pairs kept at each length."""
    lines = []
    if len(lengths) == 1:
        lines.append(
            f"{'mode':<8}{'top-k':>6}{'loss':>9}{'ppl':>10}{'accuracy':>10}"
            f"{'pairs kept':>12}{'attn ms':>10}   (seq {lengths[0]})"
        )
        for r in rows:
            lines.append(
                f"{r['mode']:<8}{r['top_k'] or '':>6}{r['loss']:>9.4f}{r['ppl']:>10.2f}"
                f"{r['accuracy']:>10.3f}{r['pairs_kept']:>12.3f}"
                f"{r['attention_ms']:>10.1f}"
            )
        return "\n".join(lines)
    columns = (("ppl", "ppl", ".2f"), ("acc", "accuracy", ".3f"), ("kept", "pairs_kept", ".3f"))
    lines.append(
        f"{'mode':<8}{'top-k':>6}"
        + "".join(f"{f'{name}@{n}':>11}" for name, _, _ in columns for n in lengths)
    )
    for i in range(0, len(rows), len(lengths)):
        group = rows[i : i + len(lengths)]
        lines.append(
            f"{group[0]['mode']:<8}{group[0]['top_k'] or '':>6}"
            + "".join(f"{r[key]:>11{fmt}}" for _, key, fmt in columns for r in group)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
