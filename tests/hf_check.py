"""What a serving or evaluation stack does with an exported folder, under whichever transformers
this interpreter imports: `python tests/hf_check.py REQUEST.json RESULT.json`.

REQUEST: {"folders": [...], "tokens": [[...]], "text": str, "new_tokens": int}. For each folder
(and, for Focus models, each mode), RESULT holds the logits of `tokens`, a greedy `generate()`
with the cache, the same without it, and the tokenizer's ids of `text`; `test_hf.py` runs it with
transformers 4 to compare with what transformers 5 gives in the test's own process.
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
    out = {"class": type(model).__name__, "ids": tokenizer(text).input_ids}
    for mode in modes:
        if mode is not None:
            model.set_focus_mode(mode)
        with torch.no_grad():
            logits = model(tokens).logits
        generated = {
            cache: model.generate(
                tokens[:, :8], max_new_tokens=new_tokens, do_sample=False, use_cache=cache
            ).tolist()
            for cache in (True, False)
        }
        out[str(mode)] = {"logits": logits.tolist(), "generated": generated}
    return out


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
