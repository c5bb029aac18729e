"""Context parallelism on the CPU: activation memory per rank and step time against C.

For each variant, sequence length and context-parallel size C, C processes (gloo) run the same
model on one sequence split in Megatron's 2C chunks; rank 0 reports

* activation memory: the bytes autograd keeps for backward during the forward (each storage
  counted once), the memory context parallelism divides; the ideal is one process's / C;
* step time: forward + backward, the mean of the steps after the first;
* gathered K/V: the bytes of keys and values a rank receives per layer (the exchange), and the
  Sinkhorn scan's per layer (K masses per chunk and iteration, float64), for Focus.

The runs are side by side in one invocation, so the ratios compare like with like; on a 2-core
machine C = 4 shares two cores between four ranks, so its time is no speed-up figure.

    python benchmarks/context_parallel.py [--seq-lengths 8192 16384] [--sizes 1 2 4]
        [--variants standard focus] [--json out.json]
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--micro-batch-size",
    "1",
]
VARIANTS = {
    "standard": [],
    "focus": ["--attention", "focus", "--focus-groups", "8", "--focus-chunk-size", "512"],
}
VOCAB = 4096


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def _worker(rank, size, port, argv, steps, out):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    sys.path.insert(0, ROOT)
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    args = parse_args(argv)
    platform.init_distributed(1, context_parallel_size=args.context_parallel_size)
    platform.manual_seed(0)
    model = build_model(args, VOCAB)
    tokens = torch.randint(
        0, VOCAB, (1, args.seq_length), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.arange(args.seq_length)[None]
    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": tokens, "position_ids": positions}
    )
    times, saved = [], 0
    for step in range(steps):
        storages = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.sum().backward()
        times.append(time.perf_counter() - started)
        saved = sum(storages.values())
        model.zero_grad(set_to_none=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"saved_bytes": saved, "step_s": sum(times[1:]) / len(times[1:])}, f)
    platform.destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(variant: str, seq: int, size: int, steps: int) -> dict:
    argv = (
        MODEL
        + VARIANTS[variant]
        + [
            "--seq-length",
            str(seq),
            "--context-parallel-size",
            str(size),
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(VOCAB),
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker, args=(size, _free_port(), argv, steps, out), nprocs=size, start_method="spawn"
        )
        with open(out) as f:
            return json.load(f)


def exchange(variant: str, seq: int, size: int, groups: int = 8, iters: int = 10) -> dict:
    """Bytes a rank receives per layer (fp32, batch 1): the other ranks' keys and values, and
    the Sinkhorn scan's chunk masses (float64, K per chunk, every iteration)."""
    heads, head_dim = 4, 64
    kv = 2 * heads * head_dim * 4 * seq * (size - 1) // size
    scan = 2 * groups * 8 * (size - 1) * iters if variant == "focus" else 0
    return {"kv_bytes": kv, "scan_bytes": scan}


def main() -> None:
    args = parse()
    rows = []
    for variant in args.variants:
        for seq in args.seq_lengths:
            base = None
            for size in args.sizes:
                result = {"variant": variant, "seq": seq, "cp": size}
                result.update(run(variant, seq, size, args.steps), **exchange(variant, seq, size))
                base = base or result
                result["memory_vs_ideal"] = result["saved_bytes"] / (base["saved_bytes"] / size)
                rows.append(result)
                print(
                    f"{variant:9s} seq {seq:6d} CP {size}: activations "
                    f"{result['saved_bytes'] / 2**20:8.1f} MiB per rank "
                    f"({result['memory_vs_ideal']:.2f}x the ideal 1/C), step "
                    f"{result['step_s']:.2f} s, K/V received {result['kv_bytes'] / 2**20:.1f} "
                    f"MiB/layer, Sinkhorn scan {result['scan_bytes']} B/layer",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
