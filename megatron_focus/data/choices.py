"""The tokenizer names `--tokenizer-type` takes, in a module that imports nothing heavy:
`pretrain_gpt.py --help` and the tools build their parsers without torch, DeepSpeed or
Megatron-Core. (The attention variants' names are in variants.py.)"""

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
)  # data/tokenizer.py
