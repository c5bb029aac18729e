"""The exported model where users run it: prefill time and decoding tokens/s of a Focus model in
sparse mode against the standard model of the same shape, at long context.

Both are `MegatronFocusForCausalLM` built from a config (random weights: speed does not depend
on them) and run as `generate()` runs them: the prompt prefilled through the cache in chunks of
`--prefill-chunk` tokens, then one token per step. The models are interleaved in one process,
context by context, so the machine's noise falls on all of them; each row's ratio is against the
standard model measured beside it. Cache bytes count every tensor the cache holds (keys, values
and Focus's routing state).

    python benchmarks/focus_generate.py                      # 4K, 16K, 32K tokens of context
    python benchmarks/focus_generate.py --contexts 4096 --json out.json
"""

import argparse
import json
import time

import torch

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


def model(attention: str, top_k: int, context: int):
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
    return MegatronFocusForCausalLM(config).eval()


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


@torch.no_grad()
def run(lm, tokens: torch.Tensor, chunk: int, steps: int) -> dict:
    """Prefill `tokens` [1, n] through the cache, then `steps` greedy decoding steps."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    started = time.perf_counter()
    for start in range(0, tokens.shape[1], chunk):
        out = lm(tokens[:, start : start + chunk], past_key_values=cache, use_cache=True)
    prefill = time.perf_counter() - started
    token = out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(steps):
        token = lm(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - started
    return {
        "prefill_s": prefill,
        "decode_tok_s": steps / decode,
        "cache_mb": cache_bytes(cache) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16, help="decoding steps timed per model")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (CI)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if args.tiny:
        args.contexts, args.prefill_chunk, args.steps = [512], 256, 4
    torch.set_grad_enabled(False)
    rows = []
    for context in args.contexts:
        tokens = torch.randint(
            0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1)
        )
        models = [("standard", None)] + [("focus", k) for k in args.top_k]
        measured = {
            (name, k): run(model(name, k or 1, context), tokens, args.prefill_chunk, args.steps)
            for name, k in models
        }
        base = measured[("standard", None)]
        for (name, k), row in measured.items():
            rows.append(
                {
                    "context": context,
                    "model": name if k is None else f"focus sparse top-{k}",
                    **row,
                    "prefill_speedup": base["prefill_s"] / row["prefill_s"],
                    "decode_speedup": row["decode_tok_s"] / base["decode_tok_s"],
                }
            )
    print(
        f"{'context':>8} {'model':<20} {'prefill s':>10} {'x std':>6} {'decode tok/s':>13} "
        f"{'x std':>6} {'cache MB':>9}"
    )
    for r in rows:
        print(
            f"{r['context']:>8} {r['model']:<20} {r['prefill_s']:>10.2f} "
            f"{r['prefill_speedup']:>6.2f} "
            f"{r['decode_tok_s']:>13.1f} {r['decode_speedup']:>6.2f} {r['cache_mb']:>9.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": SHAPE, "prefill_chunk": args.prefill_chunk, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
