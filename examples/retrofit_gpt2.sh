#!/usr/bin/env bash
# The Focus paper's GPT-2 124M retrofit (PG-19, sequence 1024, 4000 steps, K = 4):
# examples/retrofit.sh with MODEL=gpt2; its header lists the steps, what to bring and the settings.
#
#   HF_DIR=gpt2 PG19=pg19 examples/retrofit_gpt2.sh
exec env MODEL=gpt2 bash "$(dirname "${BASH_SOURCE[0]}")/retrofit.sh" "$@"
