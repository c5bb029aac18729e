"""Attention variants' overhead: training step time (forward + backward) and peak memory against
the first variant (`standard` by default), at one or several sequence lengths.

All models come from the same flags and seed and step on the same tokens. Repetitions cycle
through the variants, reversing the order every other time, so drift in the machine's speed
(clock, other processes) hits all alike; each ratio is the median of the per-repetition ratios.

Peak memory is measured after the timed steps, in a few more steps of each: the most a step needs
above what is in use before it (the step's activations, gradients and temporaries; gradients are
freed between steps):
  * GPU: `torch.cuda.max_memory_allocated()` minus `memory_allocated()` before the step, with the
    peak reset before each step.
  * CPU (Linux): the process's peak resident set (VmHWM, reset by writing 5 to
    /proc/self/clear_refs) minus its resident set before the step, after `malloc_trim` has handed
    freed heap memory back to the OS. For these steps glibc mmaps every allocation of 64 KiB or more
    (not while timing: each would cost page faults), so a freed tensor leaves the resident set at
    once and the resident set follows the live tensors.

    python benchmarks/variant_overhead.py [--variants standard xsa focus focus+xsa]
        [--seq-lengths 512 2048] [--hidden-size 256 --num-layers 4 --micro-batch-size 4
        --iters 20] [--json out.json] [other model flags, e.g. --swiglu --focus-groups 4]
"""

import argparse
import ctypes
import ctypes.util
import json
import re
import statistics
import sys

import torch

from megatron_focus import platform
from megatron_focus.model.gpt import build_model
from megatron_focus.training.arguments import parse_args

from timing import seconds

MEMORY_REPETITIONS = 3
MiB = 2**20
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description="attention variants vs the first one: step time and memory",
        allow_abbrev=False,
        epilog="Any other flag goes to the model (e.g. --swiglu, --attention-dropout 0).",
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["standard", "xsa"],
        help="the first is the baseline of the ratios",
    )
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[256])
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="small by default, so that on a CPU the output layer does not dominate",
    )
    p.add_argument("--iters", type=int, default=20, help="measured repetitions of each variant")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured repetitions first")
    p.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    opts, model_argv = p.parse_known_args()  # the rest go to the model, as megatron-focus flags
    if opts.iters < 2:
        p.error("--iters must be at least 2 (the table reports quartiles)")
    return opts, model_argv


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak_memory(device: torch.device) -> int:
    """Forget the peak so far; return the bytes in use now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (Linux >= 4.0)
    return _resident_bytes("VmRSS")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _resident_bytes("VmHWM")


def _mmap_large_allocations() -> None:
    """Freed CPU tensors go back to the OS (glibc would otherwise keep them for reuse)."""
    M_MMAP_THRESHOLD = -3
    LIBC.mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def step(model, tokens, positions) -> None:
    model.zero_grad(set_to_none=True)
    model(tokens, positions, None, labels=tokens).float().mean().backward()


def step_peak_bytes(model, tokens, positions, device) -> int:
    model.zero_grad(set_to_none=True)  # before the reset: the step's gradients count
    before = reset_peak_memory(device)
    step(model, tokens, positions)
    return peak_memory(device) - before


def interleaved(measure, models, repetitions: int, skip: int = 0) -> dict:
    """`measure(model)` of every variant, reversing the order each time; the first `skip`
    dropped."""
    samples = {variant: [] for variant in models}
    order = list(models)
    for rep in range(skip + repetitions):
        for variant in order if rep % 2 == 0 else order[::-1]:
            sample = measure(models[variant])
            if rep >= skip:
                samples[variant].append(sample)
    return samples


def run(opts: argparse.Namespace, model_argv: list[str], seq_length: int) -> dict:
    device = platform.init_distributed(1).device
    size = [
        "--hidden-size",
        str(opts.hidden_size),
        "--num-layers",
        str(opts.num_layers),
        "--num-attention-heads",
        str(opts.num_attention_heads),
        "--seq-length",
        str(seq_length),
    ]
    g = torch.Generator().manual_seed(opts.seed)
    shape = (opts.micro_batch_size, seq_length)
    tokens = torch.randint(0, opts.vocab_size, shape, generator=g).to(device)
    positions = torch.arange(seq_length, device=device).expand(shape)
    models, errors = {}, {}
    for variant in opts.variants:  # one that fails to build or step is reported, not measured
        platform.manual_seed(opts.seed)
        try:
            model = build_model(
                parse_args(size + model_argv + ["--attention", variant]), opts.vocab_size
            ).to(device)
            if opts.bf16:
                model.bfloat16()
            step(model, tokens, positions)
            models[variant] = model
        except (RuntimeError, ValueError, NotImplementedError) as e:
            errors[variant] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if opts.variants[0] in errors:
        return {"seq_length": seq_length, "results": {}, "errors": errors}

    times = interleaved(
        lambda model: seconds(lambda: step(model, tokens, positions)),
        models,
        opts.iters,
        skip=opts.warmup,
    )
    if device.type == "cpu":
        _mmap_large_allocations()
    peaks = interleaved(
        lambda model: step_peak_bytes(model, tokens, positions, device), models, MEMORY_REPETITIONS
    )
    base = opts.variants[0]

    def summary(variant):
        q1, _, q3 = statistics.quantiles(times[variant], n=4)
        return {
            "step_ms": 1e3 * statistics.median(times[variant]),
            "step_ms_iqr": [1e3 * q1, 1e3 * q3],
            "peak_step_memory_mib": statistics.median(peaks[variant]) / MiB,
            "step_time_ratio": statistics.median(
                x / b for x, b in zip(times[variant], times[base])
            ),
            "peak_step_memory_ratio": statistics.median(
                x / b for x, b in zip(peaks[variant], peaks[base])
            ),
        }

    return {
        "seq_length": seq_length,
        "results": {variant: summary(variant) for variant in models},
        "errors": errors,
    }


def describe(opts: argparse.Namespace, model_argv: list[str]) -> dict:
    device = platform.setup().device
    return {
        **vars(opts),
        "model_flags": model_argv,
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "dtype": "bf16" if opts.bf16 else "fp32",
        "memory_measured": (
            "CUDA max_memory_allocated above the allocation before the step"
            if device.type == "cuda"
            else "peak resident set (VmHWM) above the resident set before the "
            "step, after malloc_trim, allocations >= 64 KiB mmapped"
        ),
    }


def table(config: dict, runs: list) -> str:
    where = config["device"] + (f", {config['threads']} threads" if config["threads"] else "")
    rows = [
        f"hidden {config['hidden_size']}, layers {config['num_layers']}, heads "
        f"{config['num_attention_heads']}, micro-batch {config['micro_batch_size']}, vocab "
        f"{config['vocab_size']}, {config['dtype']} {' '.join(config['model_flags'])}".rstrip(),
        f"{where}; {config['iters']} interleaved repetitions after {config['warmup']} warm-up",
        f"memory: {config['memory_measured']}",
        "",
        f"{'seq':>6} {'variant':<11}{'step ms':>10}{'[IQR]':>20}{'peak MiB':>10}"
        f"{'time x':>8}{'mem x':>8}",
    ]
    for run in runs:
        for variant, error in run["errors"].items():
            rows.append(f"{run['seq_length']:>6} {variant:<11} failed: {error}")
        for variant, r in run["results"].items():
            lo, hi = r["step_ms_iqr"]
            rows.append(
                f"{run['seq_length']:>6} {variant:<11}{r['step_ms']:>10.1f}"
                f"{f'[{lo:.1f}, {hi:.1f}]':>20}{r['peak_step_memory_mib']:>10.1f}"
                f"{r['step_time_ratio']:>8.3f}{r['peak_step_memory_ratio']:>8.3f}"
            )
    return "\n".join(rows)


def main() -> None:
    opts, model_argv = parse()
    config = describe(opts, model_argv)
    runs = []
    for n in opts.seq_lengths:
        runs.append(run(opts, model_argv, n))
        if opts.json:  # after each length: a later failure loses nothing measured
            with open(opts.json, "w") as f:
                json.dump({"config": config, "runs": runs}, f, indent=2)
    print(table(config, runs))
    platform.destroy_distributed()
    if any(run["errors"] for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
