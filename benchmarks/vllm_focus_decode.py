"""What decoding costs under vLLM: a Focus export (soft and sparse mode, through this package's
plugin) against the same model with standard attention (vLLM's own paged attention), at long
contexts. Whether or not Focus is faster, the table says so.

Two steps, in two environments (as examples/serve_with_vllm.py):

    # where megatron-focus is installed: two Llama-family exports of the same shape, random
    # weights, one standard and one Focus
    python benchmarks/vllm_focus_decode.py export vllm-bench

    # where vLLM and this package's plugin are installed
    python benchmarks/vllm_focus_decode.py measure vllm-bench --json decode.json

For each model and context, one prompt of that many random tokens is prefilled and NEW tokens
decoded greedily; the engine's own timestamps of the request (vLLM's request metrics) give the
prefill (scheduled to first token) and the decoding step (first to last token, per token).
Ratios are to the standard model at the same context, in the same run.
"""

import argparse
import json
import os
import sys

NEW = 32
SHAPE = dict(  # a small Llama: the ratios, not the absolute times, are the measure
    vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, normalization="RMSNorm",
    activation="swiglu", position_embedding_type="rope", bias=False,
    max_position_embeddings=65536,
)  # fmt: skip
FOCUS = dict(focus_groups=8, focus_window=128, focus_top_k=1, focus_sink_tokens=4)
# each engine's KV cache, not the CPU backend's default share of the machine's memory: the
# engines run one after another in one process (a Focus layer's float32 row per token is
# 1.4 KB here, 90 MB per layer at 32K)
KV_CACHE_BYTES = 2 << 30


def export(out: str) -> None:
    """The two folders, saved with their code (`auto_map`) as the package's export saves one."""
    import torch

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    MegatronFocusConfig.register_for_auto_class()
    MegatronFocusForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    layers = SHAPE["num_hidden_layers"]
    for name, extra in (("standard", {}), ("focus", FOCUS)):
        kinds = ["focus" if extra else "standard"] * layers
        config = MegatronFocusConfig(**SHAPE, **extra, layer_attention=kinds)
        torch.manual_seed(0)
        MegatronFocusForCausalLM(config).save_pretrained(os.path.join(out, name))
        print(f"{name}: {os.path.join(out, name)}", flush=True)


def _decode_times(folder: str, contexts: list, mode: str = None) -> dict:
    """{context: (seconds per decoding step, seconds of the prefill)} in one engine."""
    import random

    from vllm import LLM, SamplingParams

    overrides = {"focus_attention_mode": mode} if mode else {}
    llm = LLM(model=folder, trust_remote_code=True, dtype="float32", enforce_eager=True, seed=0,
              skip_tokenizer_init=True, hf_overrides=overrides, enable_prefix_caching=False,
              max_model_len=max(contexts) + NEW + 1, disable_log_stats=False,
              kv_cache_memory_bytes=KV_CACHE_BYTES)  # fmt: skip
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=NEW + 1, min_tokens=NEW + 1)
    times = {}
    for context in contexts:
        tokens = [rng.randrange(1, SHAPE["vocab_size"]) for _ in range(context)]
        (output,) = llm.generate([{"prompt_token_ids": tokens}], greedy, use_tqdm=False)
        m = output.metrics  # the engine's timestamps of this request
        times[context] = (
            (m.last_token_ts - m.first_token_ts) / NEW,
            m.first_token_ts - m.scheduled_ts,
        )
        print(f"  {os.path.basename(folder)} {mode or ''} {context}: {times[context]}", flush=True)
    llm.llm_engine.engine_core.shutdown()  # its processes and memory, before the next engine
    return times


def measure(out: str, contexts: list, json_path: str = None) -> None:
    runs = {
        "standard": _decode_times(os.path.join(out, "standard"), contexts),
        "focus soft": _decode_times(os.path.join(out, "focus"), contexts, "soft"),
        "focus sparse": _decode_times(os.path.join(out, "focus"), contexts, "sparse"),
    }
    print(f"\n{'model':14} {'context':>8} {'ms/step':>9} {'vs standard':>12} {'prefill s':>10}")
    rows = []
    for name, times in runs.items():
        for context, (step, prefill) in times.items():
            ratio = step / runs["standard"][context][0]
            print(f"{name:14} {context:8} {1e3 * step:9.2f} {ratio:11.2f}x {prefill:10.2f}")
            rows.append(dict(model=name, context=context, ms_per_step=1e3 * step,
                             vs_standard=ratio, prefill_s=prefill))  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"shape": SHAPE, "focus": FOCUS, "new_tokens": NEW, "rows": rows}, f, indent=1
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("step", choices=["export", "measure"])
    p.add_argument("folder")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--json", help="write the table's rows here")
    args = p.parse_args()
    if args.step == "export":
        export(args.folder)
    else:
        measure(args.folder, args.contexts, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
