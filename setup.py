"""megatron-focus: Focus and XSA attention for Megatron-Core GPT pretraining."""

from setuptools import find_packages, setup

# torch is pinned exactly: a bare `torch` requirement pulls a multi-GB CUDA build on a CPU machine.
# On a GPU cluster, install the CUDA build of the same version first; pip then keeps it.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",  # 0.17+ needs Python 3.12
    "deepspeed==0.19.8",
    "sentencepiece==0.2.3",
    "tokenizers>=0.21,<0.24",
    "tensorboard>=2.18,<3",
    "numpy>=1.26,<3",
    "pyarrow>=15",
    "tqdm>=4.66",
]

EXTRAS = {
    "test": ["pytest>=8", "hypothesis>=6.100", "matplotlib>=3.8"],
    "plot": ["matplotlib>=3.8"],  # tools/compare_runs.py
    "hf": ["transformers==5.24.0", "safetensors>=0.4", "protobuf>=4"],  # protobuf: SP conversion
    "gpu": ["flash-attn>=2.6"],
}

setup(
    name="megatron-focus",
    version="0.1.0",
    description="Focus (learned sparse) and XSA (exclusive self) attention on Megatron-Core",
    packages=find_packages(include=["megatron_focus", "megatron_focus.*"]),
    python_requires=">=3.10,<3.12",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
