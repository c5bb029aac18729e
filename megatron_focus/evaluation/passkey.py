"""Passkey retrieval (Mohtashami & Jaggi, 2023): a number hidden at a chosen depth in filler text,
asked for at the end. A model retrieves it only by attending from the question back to the
needle, however far: with Focus's hard rule, only if routing keeps that pair.

The prompt is built in token ids of the model's own tokenizer, to a length in tokens: the task
statement, filler sentences, the needle ("The pass key is 71432. Remember it. 71432 is the pass
key.") placed so that a `depth` share of the filler comes before it, more filler, then the
question ("What is the pass key? The pass key is"). An answer counts when the greedy
continuation's first digits are the passkey.
"""

import random
from typing import Callable, List

import torch

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important info there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(
    tokenize: Callable[[str], List[int]], length: int, depth: float, key: int
) -> List[int]:
    """Token ids of a prompt of at most `length` tokens with `key` at `depth` (0: right after the
    task statement, 1: right before the question) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be between 0 and 1")
    task, needle, question = (tokenize(text) for text in (TASK, NEEDLE.format(key=key), QUESTION))
    filler = tokenize(FILLER)
    room = length - len(task) - len(needle) - len(question)
    if room < 0:
        raise ValueError(
            f"a prompt of {length} tokens cannot hold the task, needle and question "
            f"({length - room} tokens)"
        )
    padding = (filler * (room // len(filler) + 1))[:room]
    before = int(round(depth * room))
    return task + padding[:before] + needle + padding[before:] + question


def retrieved(continuation: str, key: int) -> bool:
    digits = "".join(c for c in continuation.strip() if c.isdigit() or c == " ").split()
    return bool(digits) and digits[0] == str(key)


@torch.no_grad()
def greedy(
    logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: List[int], new_tokens: int, device
) -> List[int]:
    """`new_tokens` greedy tokens after `prompt`; `logits_of(tokens [1, n])` -> [1, n, vocab]."""
    tokens = torch.tensor([prompt], device=device)
    for _ in range(new_tokens):
        next_token = logits_of(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[0, len(prompt) :].tolist()


def keys(trials: int, seed: int) -> List[int]:
    """The passkeys of `trials` prompts: five-digit numbers, the same for every setting."""
    rng = random.Random(seed)
    return [rng.randrange(10_000, 100_000) for _ in range(trials)]
