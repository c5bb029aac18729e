"""megatron-focus: Focus and XSA attention for Megatron-Core GPT pretraining."""

from setuptools import find_packages, setup

# torch is a range: a GPU cluster keeps the CUDA build it already has (2.11 is the oldest the
# suite passes on, 2.15 the newest tested). The CPU install pins the CPU build through
# constraints/cpu.txt (a bare `torch` from PyPI is a multi-GB CUDA build).
INSTALL_REQUIRES = [
    "torch>=2.11,<2.16",
    # 0.16.1 is the newest for Python 3.10 and 3.11; 0.17+ need Python 3.12 (.ci/run tests 0.19.2)
    "megatron-core>=0.16.1,<0.20",
    "deepspeed==0.19.8",
    "sentencepiece==0.2.3",
    "tokenizers>=0.21,<0.24",
    "tensorboard>=2.18,<3",
    "numpy>=1.26,<3",
    "pyarrow>=15",
    "tqdm>=4.66",
    "pyyaml>=6",  # --yaml-cfg
    "psutil>=5.9",  # the checkpoint folder's lock: is its holder's process alive
]

EXTRAS = {
    # not wandb: Megatron-Core imports it whenever it is installed (~1 s in every test process)
    # ruff: pinned, as its format differs between releases (.ci/run checks lint and format)
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.8",  # --no-loadscope-reorder
        "hypothesis>=6.100",
        "matplotlib>=3.8",
        "ruff==0.17.6",
        # the Triton kernels' tests run them under its interpreter on CPU tensors (a CUDA torch
        # brings its own Triton)
        "triton>=3.3",
    ],
    # --wandb-project; offline (WANDB_MODE=offline) needs no network
    "wandb": ["wandb>=0.19,<0.32"],
    "plot": ["matplotlib>=3.8"],  # tools/compare_runs.py
    # transformers: 4.57.6 and 5.24.0 are tested (.ci/run); protobuf: SentencePiece conversion
    "hf": ["transformers>=4.57,<5.25", "safetensors>=0.4", "protobuf>=4"],
    "eval": ["lm_eval==0.4.13", "accelerate>=1.0"],  # examples/lm_eval: lm-evaluation-harness
    "gpu": ["flash-attn>=2.6"],
}

setup(
    name="megatron-focus",
    version="0.1.0",
    description="Focus (learned sparse) and XSA (exclusive self) attention on Megatron-Core",
    packages=find_packages(include=["megatron_focus", "megatron_focus.*"]),
    # compat.py's records of Megatron-LM's parsers
    package_data={
        "megatron_focus": [
            "config/megatron_lm_flags.txt",
            "config/megatron_lm_preprocess_flags.txt",
        ]
    },
    python_requires=">=3.10,<3.13",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    # torchrun loads it at start: a refusal's exit is final, not restarted (launchers.py); a
    # module of its own, as every process that imports torchelastic's rendezvous loads it
    py_modules=["megatron_focus_torchrun"],
    entry_points={
        "torchrun.handlers": ["megatron-focus = megatron_focus_torchrun:plugin"],
        # vLLM serves the exports, Focus included (megatron_focus/vllm_plugin.py)
        "vllm.general_plugins": ["megatron-focus = megatron_focus.vllm_plugin:register"],
    },
)
