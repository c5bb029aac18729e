"""The exported model where users run it: prefill time and decoding tokens/s of a Focus model in
sparse mode against the standard model of the same shape, at long context.

Both are `MegatronFocusForCausalLM` built from a config (random weights: speed does not depend
on them) and run as `generate()` runs them: the prompt prefilled through the cache in chunks of
`--prefill-chunk` tokens, then one token per step. The models are interleaved in one process,
context by context, so the machine's noise falls on all of them; each row's ratio is against the
standard model measured beside it, whose cache grows in place as Focus's does ("stock cache":
the same model in transformers' own cache layers, which copy the whole cache at every step,
as a transformers Llama's do); "ideal" is the prefill's dense pairs over the pairs the rule
keeps with balanced groups, "of ideal" the measured speed-up's share of it; the decoding "bound"
is the standard model's tokens/s with `focus_window` tokens of context over its tokens/s at this
context: what a step attending to the window alone would gain, the most any sparse rule can
give a model of this shape (its projections, MLPs and head cost the same); "kept bd" (Focus rows)
is what a step would gain that paid that window-only step's cost and, beyond it, the standard
step's attention cost for the share of keys the rule keeps: the pairs' bound with the step's
fixed cost counted. Cache bytes count
every tensor the cache holds (keys, values, Focus's routing state; buckets as allocated).

`--static` adds each model with transformers' StaticCache ("static, graph" rows): the prompt
prefilled eagerly, then every decoding step one compiled graph (`torch.compile(fullgraph=True)`,
"reduce-overhead" on a GPU: a CUDA graph replayed per step; the eager backend on the CPU), after
3 untimed steps that compile and record it. Such a step pays no host time per layer; a sparse
Focus step reads the slots its rule keeps through megatron-focus's decoding kernel on a GPU in
bf16 (else one mask over every slot, as the standard model's step reads every slot).

    python benchmarks/focus_generate.py                      # 4K, 16K, 32K tokens of context
    python benchmarks/focus_generate.py --contexts 4096 --json out.json
    python benchmarks/focus_generate.py --repeats 3          # medians of three interleaved runs
    python benchmarks/focus_generate.py --static --contexts 4096 --top-k 1   # + graphed steps
"""

import argparse
import json
import statistics
import time

import torch

from timing import synchronize

SHAPE = dict(  # 4 layers, hidden 256, 8 heads, RoPE, RMSNorm, SwiGLU; Focus K 8, window 128
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=1024,
    num_attention_heads=8,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    vocab_size=1024,
    focus_groups=8,
    focus_window=128,
)


def model(attention: str, top_k: int, context: int, device: str, dtype: torch.dtype):
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    config = MegatronFocusConfig(
        **SHAPE,
        max_position_embeddings=context + 64,
        layer_attention=[attention] * SHAPE["num_hidden_layers"],
        focus_attention_mode="sparse",
        focus_top_k=top_k,
    )
    torch.manual_seed(0)
    return MegatronFocusForCausalLM(config).eval().to(device, dtype)


def kept_share(context: int, top_k: int) -> float:
    """The share of a causal prefill's pairs the sparse rule keeps with balanced groups: the
    window's, and top_k / K of the distant ones (their inverse: the ideal speed-up)."""
    window, groups = SHAPE["focus_window"], SHAPE["focus_groups"]
    distant = (context - window) * (context - window + 1) / 2
    return (context * (context + 1) / 2 - distant * (1 - top_k / groups)) / (
        context * (context + 1) / 2
    )


def kept_keys(context: int, top_k: int) -> float:
    """The share of the keys a decoding step at `context` attends to with balanced groups: the
    window's and top_k / K of the others."""
    window, groups = SHAPE["focus_window"], SHAPE["focus_groups"]
    return (window + (context - window) * top_k / groups) / context


def cache_bytes(cache) -> int:
    """The bytes of every tensor the cache's layers hold (Focus's buckets' as allocated)."""

    def tensors(held):
        if torch.is_tensor(held):
            yield held
        elif isinstance(held, (list, tuple, dict)):
            for item in held.values() if isinstance(held, dict) else held:
                yield from tensors(item)
        elif hasattr(held, "__dict__") and not isinstance(held, type):
            yield from tensors(vars(held))

    unique = {
        t.untyped_storage().data_ptr(): t for layer in cache.layers for t in tensors(vars(layer))
    }
    return sum(t.untyped_storage().nbytes() for t in unique.values())


GRAPH_WARMUP = 3  # untimed steps of a graphed model: its compile and its graph's recording


def graphed_step(lm):
    """The model's forward as one compiled graph: CUDA graphs on a GPU, on the CPU the eager
    backend (the same capture, no code generation)."""
    if next(lm.parameters()).is_cuda:
        return torch.compile(lm.forward, fullgraph=True, mode="reduce-overhead")
    return torch.compile(lm.forward, fullgraph=True, backend="eager")


@torch.no_grad()
def run(lm, tokens: torch.Tensor, chunk: int, steps: int, cache_kind: str = None) -> dict:
    """Prefill `tokens` [1, n] through the cache, then `steps` greedy decoding steps; in
    transformers' own cache layers (`cache_kind` "stock"), which copy every cached key at each
    step (torch.cat), where the model's own grow in place; or a StaticCache ("static"), each
    step a graph."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import DynamicLayer

    static = cache_kind == "static"
    if static:
        length = tokens.shape[1] + GRAPH_WARMUP + steps
        cache = StaticCache(config=lm.config, max_cache_len=length)
        step = graphed_step(lm)
    else:
        cache, step = DynamicCache(config=lm.config), lm
    if cache_kind == "stock":  # a subclass: the model keeps it as it is
        cache.layers[:] = [type("Stock", (DynamicLayer,), {})() for _ in cache.layers]
    started = time.perf_counter()
    for start in range(0, tokens.shape[1], chunk):
        out = lm(tokens[:, start : start + chunk], past_key_values=cache, use_cache=True)
    synchronize()
    prefill = time.perf_counter() - started
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(GRAPH_WARMUP if static else 0):
        token = step(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        token = step(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    synchronize()
    decode = time.perf_counter() - started
    return {
        "prefill_s": prefill,
        "decode_tok_s": steps / decode,
        "cache_mb": cache_bytes(cache) / 2**20,
    }


def median_run(runs: list) -> dict:
    """Each measure's median over the repeats."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64, help="decoding steps timed per model")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of every model, interleaved; medians"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--static",
        action="store_true",
        help="also each model with a StaticCache, every decoding step a graph",
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (CI)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if args.tiny:
        args.contexts, args.prefill_chunk, args.steps = [512], 256, 4
    torch.set_grad_enabled(False)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype.replace("fp", "float"))
    rows = []
    for context in args.contexts:
        tokens = torch.randint(
            0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1)
        ).to(device)
        # (attention, top-k, cache): "stock" transformers' own layers, "static" graphed steps,
        # "floor" the standard model's step over the window's keys alone (below)
        models = [("standard", 1, None), ("standard", 1, "stock")]
        models += [("focus", k, None) for k in args.top_k]
        if args.static:
            models += [("standard", 1, "static")] + [("focus", k, "static") for k in args.top_k]
        models += [("standard", 1, "floor")]
        runs = {key: [] for key in models}
        for _ in range(args.repeats):  # interleaved, so the machine's noise falls on all
            for name, k, kind in models:
                runs[(name, k, kind)].append(
                    run(
                        model(name, k, context, device, dtype),
                        # the floor: what a sparse rule's step costs at least
                        tokens[:, : SHAPE["focus_window"]] if kind == "floor" else tokens,
                        args.prefill_chunk,
                        args.steps,
                        kind,
                    )
                )
        measured = {key: median_run(each) for key, each in runs.items()}
        floor, base = measured.pop(("standard", 1, "floor")), measured[("standard", 1, None)]
        bound = floor["decode_tok_s"] / base["decode_tok_s"]
        floor_step, base_step = 1 / floor["decode_tok_s"], 1 / base["decode_tok_s"]
        for (name, k, kind), row in measured.items():
            ideal = 1.0 if name == "standard" else 1 / kept_share(context, k)
            # a step that pays the floor and reads only the kept keys, at the standard's cost
            kept_bound = (  # not a static cache's step, which reads every slot
                None
                if name == "standard" or kind == "static"
                else base_step / (floor_step + (base_step - floor_step) * kept_keys(context, k))
            )
            prefill_speedup = base["prefill_s"] / row["prefill_s"]
            rows.append(
                {
                    "context": context,
                    "model": (name if name == "standard" else f"focus sparse top-{k}")
                    + {None: "", "stock": ", stock cache", "static": ", static, graph"}[kind],
                    **row,
                    "prefill_speedup": prefill_speedup,
                    "ideal_speedup": ideal,
                    "of_ideal": prefill_speedup / ideal,
                    "decode_speedup": row["decode_tok_s"] / base["decode_tok_s"],
                    "decode_bound": bound,
                    "decode_kept_bound": kept_bound,
                }
            )
    print(
        f"{'context':>8} {'model':<34} {'prefill s':>10} {'x std':>6} {'ideal':>6} "
        f"{'of ideal':>8} {'decode tok/s':>13} {'x std':>6} {'bound':>6} {'kept bd':>7} "
        f"{'cache MB':>9}"
    )
    for r in rows:
        kept_bound = "" if r["decode_kept_bound"] is None else f"{r['decode_kept_bound']:.2f}"
        print(
            f"{r['context']:>8} {r['model']:<34} {r['prefill_s']:>10.2f} "
            f"{r['prefill_speedup']:>6.2f} {r['ideal_speedup']:>6.1f} {r['of_ideal']:>8.0%} "
            f"{r['decode_tok_s']:>13.1f} {r['decode_speedup']:>6.2f} {r['decode_bound']:>6.2f} "
            f"{kept_bound:>7} {r['cache_mb']:>9.1f}"
        )
    if args.json:
        config = {
            "shape": SHAPE,
            "prefill_chunk": args.prefill_chunk,
            "steps": args.steps,
            "repeats": args.repeats,
            "device": args.device,
            "static": args.static,
        }
        with open(args.json, "w") as f:
            json.dump({**config, "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
