"""The names a user chooses among on the command line, in a module that imports nothing heavy:
`pretrain_gpt.py --help` builds its parser without torch, DeepSpeed or Megatron-Core. The modules
that implement each choice import their list from here."""

ATTENTION_VARIANTS = ("standard", "xsa", "focus", "focus+xsa")  # model/specs.py
FOCUS_GATES = ("log", "sigmoid")  # the soft gate on distant pairs: model/focus_gate.py
FOCUS_KERNELS = ("auto", "flex", "chunked")  # the soft gate's kernel: model/focus_gate.py
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")  # data/tokenizer.py
