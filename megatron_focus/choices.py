"""The names a user chooses among on the command line, in a module that imports nothing heavy:
`pretrain_gpt.py --help` builds its parser without torch, DeepSpeed or Megatron-Core. The modules
that implement each choice import their list from here."""

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")  # data/tokenizer.py
