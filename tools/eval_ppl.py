"""Perplexity of a checkpoint on the validation split; for Focus, the effect of top-k.

For a Focus model, one row for the soft gate (how it trained) and one per top-k = 1..K in sparse
mode (the hard rule, run by the sparse dispatch): loss, perplexity, the share of causal pairs kept
(mean over layers), and the time spent in attention — the paper's "effect of top-k" table,
measured on this model. Other models get one row.

    python tools/eval_ppl.py --load CKPT [--data-path PREFIX --tokenizer-type T --tokenizer-model M]
        [--eval-iters 20 --micro-batch-size 4 --seq-length 1024] [--json out.json]

Without --data-path it reads the embedded corpus (the default of pretrain_gpt.py). The model is
rebuilt from the checkpoint's own settings and merged to one process, whatever its TP size.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_focus import platform  # noqa: E402
from megatron_focus.arguments import build_parser, validate_args  # noqa: E402
from megatron_focus.hf.native import (  # noqa: E402
    checkpoint_tag_dir, native_model, read_architecture, read_weights)
from megatron_focus.data.loader import micro_batches  # noqa: E402
from megatron_focus.model.focus import (  # noqa: E402
    FocusAttention, focus_statistics, recording_statistics, set_focus_mode)
from megatron_focus.model.focus_gate import lse_kernel, soft_kernel  # noqa: E402
from megatron_focus.training import trainer  # noqa: E402


def parse() -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--json", metavar="PATH")
    opts, rest = p.parse_known_args()
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
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _enter(self, *_):
        self._sync()
        self._start = time.perf_counter()

    def _exit(self, *_):
        self._sync()
        self.seconds += time.perf_counter() - self._start


@torch.no_grad()
def evaluate(model, batches, timer: AttentionTimer, sparse: bool) -> dict:
    """Mean loss; pairs kept by the hard rule (all pairs are computed in soft mode)."""
    timer.seconds, total, kept = 0.0, 0.0, []
    start = time.perf_counter()
    for batch in batches:
        with recording_statistics(model):
            total += float(trainer.lm_loss(model, batch))
        stats = focus_statistics(model)
        kept += [float(v) for k, v in stats.items() if k.endswith("pairs-kept")]
    loss = total / len(batches)
    return {"loss": loss, "ppl": math.exp(min(loss, 30.0)),
            "pairs_kept": sum(kept) / len(kept) if sparse else 1.0,
            "attention_ms": timer.seconds * 1e3, "total_ms": (time.perf_counter() - start) * 1e3}


def main() -> None:
    opts, args = parse()
    platform.init_distributed(1)
    tag_dir = checkpoint_tag_dir(opts.load, opts.iteration)
    tokenizer = trainer.tokenizer_for(args, rank0=True)
    # The checkpoint's model, merged to one process whatever its TP size or ZeRO stage.
    arch = read_architecture(tag_dir, tokenizer.vocab_size)
    model = native_model(arch, read_weights(tag_dir, arch, progress=False))
    if arch.position_embedding_type == "learned_absolute":
        args.seq_length = min(args.seq_length, arch.max_position_embeddings)
    validate_args(args, world_size=1)  # the data and evaluation flags
    _, valid = trainer.datasets_for(args, tokenizer)
    if valid is None:
        raise ValueError("--split leaves no validation data, or --eval-iters is 0")
    batches = list(micro_batches(valid, 0, args.eval_iters * args.micro_batch_size,
                                 args.micro_batch_size, 1, 0))
    timer = AttentionTimer(model)

    rows = []
    if arch.focus is not None:
        settings = [("soft", None)] + [("sparse", k) for k in range(1, arch.focus.groups + 1)]
    else:
        settings = [(arch.attention, None)]
    for mode, top_k in settings:
        if arch.focus is not None:
            set_focus_mode(model, mode, top_k)
        rows.append({"mode": mode, "top_k": top_k,
                     **evaluate(model, batches, timer, sparse=mode == "sparse")})

    tokens = args.eval_iters * args.micro_batch_size * args.seq_length
    print(f"{opts.load}: {arch.attention}, {tokens} validation tokens (seq {args.seq_length})")
    kernels = None
    if arch.focus is not None:
        layer = next(m for m in model.modules() if isinstance(m, FocusAttention))
        device = next(model.parameters()).device
        kernels = {"soft": soft_kernel(layer.focus.kernel, device), "sparse": lse_kernel(device)}
        print(f"Focus kernels: soft gate {kernels['soft']}, sparse {kernels['sparse']}")
    print(f"{'mode':<8}{'top-k':>6}{'loss':>9}{'ppl':>10}{'pairs kept':>12}{'attn ms':>10}")
    for r in rows:
        top_k = "" if r["top_k"] is None else r["top_k"]
        print(f"{r['mode']:<8}{top_k:>6}{r['loss']:>9.4f}{r['ppl']:>10.2f}"
              f"{r['pairs_kept']:>12.3f}{r['attention_ms']:>10.1f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"load": opts.load, "attention": arch.attention, "tokens": tokens,
                       "focus_kernels": kernels, "rows": rows}, f, indent=2)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
