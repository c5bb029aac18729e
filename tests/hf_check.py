"""What a serving or evaluation stack does with an exported folder, under whichever transformers
this interpreter imports: `python tests/hf_check.py REQUEST.json RESULT.json`.

REQUEST: {"folders": [...], "tokens": [[...]], "text": str, "new_tokens": int}. For each folder
(and, for Focus models, each mode), RESULT holds the logits of `tokens`, a greedy `generate()`
with the cache, the same without it, the tokenizer's ids of `text`, and the logits and cached
greedy generation from the tokenizer's whole output (`model(**tok(text))`); the HF tests run it
with transformers 4 to compare with what transformers 5, or the native model, gives.
"""

import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def check(folder: str, tokens: torch.Tensor, text: str, new_tokens: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    model.generation_config.eos_token_id = None  # exactly new_tokens, no early stop
    modes = ["soft", "sparse"] if hasattr(model, "set_focus_mode") else [None]
    encoded = tokenizer(text, return_tensors="pt")
    out = {"class": type(model).__name__, "ids": encoded.input_ids[0].tolist()}
    for mode in modes:
        if mode is not None:
            model.set_focus_mode(mode)
        with torch.no_grad():
            logits, text_logits = model(tokens).logits, model(**encoded).logits
        generated = {
            cache: model.generate(
                tokens[:, :8], max_new_tokens=new_tokens, do_sample=False, use_cache=cache
            ).tolist()
            for cache in (True, False)
        }
        text_generated = model.generate(**encoded, max_new_tokens=new_tokens, do_sample=False)
        out[str(mode)] = {
            "logits": logits.tolist(),
            "generated": generated,
            "text_logits": text_logits.tolist(),
            "text_generated": text_generated.tolist(),
        }
    return out


def run_under(transformers_dir: str, request: dict, work_dir) -> dict:
    """RESULT of `request`, run in a subprocess that imports transformers from `transformers_dir`
    (a `pip install --target` folder)."""
    import os
    import subprocess

    request_path, result_path = (os.path.join(work_dir, f"{n}.json") for n in ("request", "result"))
    with open(request_path, "w") as f:
        json.dump(request, f)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([transformers_dir, here])}
    subprocess.run([sys.executable, __file__, request_path, result_path], env=env, check=True)
    with open(result_path) as f:
        return json.load(f)


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    tokens = torch.tensor(request["tokens"])
    result = {
        "transformers": transformers.__version__,
        "folders": {
            folder: check(folder, tokens, request["text"], request["new_tokens"])
            for folder in request["folders"]
        },
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
