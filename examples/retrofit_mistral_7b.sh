#!/usr/bin/env bash
# The Focus paper's Mistral-7B-Instruct retrofit (K = 2, 2000 steps, 8 GPUs):
# examples/retrofit.sh with MODEL=mistral-7b; its header lists the steps, what to bring and the settings.
#
#   HF_DIR=Mistral-7B-Instruct-v0.2 PG19=pg19 examples/retrofit_mistral_7b.sh
exec env MODEL=mistral-7b bash "$(dirname "${BASH_SOURCE[0]}")/retrofit.sh" "$@"
