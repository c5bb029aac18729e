#!/usr/bin/env bash
# Wheels that a lent GPU machine (Python 3.12, its own CUDA torch, no network) lacks, into .whl/:
# the versions this project pins and tests on the CPU. Run here, with network, before
# benchmarks/gpu_session.sh; .whl/ is git-ignored and travels with the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# transformers: the pinned one (the machine's is older); regex: its floor is newer than some
# images' (transformers checks it at import).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl megatron-core==0.19.2 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 transformers==5.24.0 regex==2026.11.19
python3 -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl   # an sdist on PyPI: pure Python
ls -la .whl
