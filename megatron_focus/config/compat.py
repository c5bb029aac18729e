"""Every flag of Megatron-LM's `pretrain_gpt.py` that this trainer does not implement itself.

A launch script brings Megatron-LM's flags along; each one is known here, with Megatron-LM's
own argparse keywords (megatron_lm_flags.txt, read from its parser), so that a script that gives
it a value parses. Beyond the flags this trainer implements (flags.py), three kinds, each
shown by `pretrain_gpt.py --help`:

- *no effect here*: they tune what this trainer replaces (fused CUDA kernels, Transformer
  Engine's communication overlap, CUDA graphs, Megatron's DDP buckets and distributed
  checkpoints, NVIDIA's logging services): accepted so that the script runs, and said to do
  nothing;
- *refused*: what this trainer does not offer (mixture of experts, pipeline parallelism, fp8,
  multi-latent attention, other models ...), refused by feature name before any compute, with
  what to use instead, unless given at the value that means "off" (Megatron-LM's default), so
  that a script spelling out defaults runs;
- *translated*: Megatron's name for something DeepSpeed does here (`--use-distributed-optimizer`
  is ZeRO-1, `--overlap-grad-reduce` / `--overlap-param-gather` DeepSpeed's overlapped
  communication), or Megatron's older name for a flag of this trainer.

Flags that share one reason are one family, named by shell-style patterns (`--moe-*`); the first
family whose pattern matches a flag says what it is.
"""

import argparse
import ast
import fnmatch
import functools
import os
from typing import Dict, List, Optional, Tuple

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_flags.txt")

TE = "Transformer Engine, which this trainer does not use"
FP8 = f"fp8 needs {TE}; use --bf16"
CHECKPOINTS = "checkpoints are --ckpt-format's: torch (DeepSpeed's files) or torch_dist"
OTHER_MODELS = (
    "for BERT, T5, retrieval (ICT, REALM, biencoder) and vision models: this trainer "
    "pretrains GPT models"
)

# patterns: why they do nothing here
NO_EFFECT = {
    "--use-mcore-models": "the model is always Megatron-Core's GPTModel",
    (
        "--pipeline-model-parallel-comm-backend --microbatch-group-size-per-virtual-pipeline-stage "
        "--overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication "
        "--use-ring-exchange-p2p --no-scatter-gather-tensors-in-pipeline "
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit"
    ): (
        "tunes the pipeline's communication and schedule, and there is no pipeline here "
        "(--pipeline-model-parallel-size 1), as in Megatron-LM without one"
    ),
    "--use-dist-ckpt --dist-ckpt-format": (
        "deprecated in Megatron-LM, where it does nothing either: --ckpt-format chooses"
    ),
    "--transformer-impl": f"the layers are Megatron-Core's local (PyTorch) modules, without {TE}",
    "--no-masked-softmax-fusion --attention-softmax-in-fp32 --apply-query-key-layer-scaling": (
        "attention runs in PyTorch's, flash-attn's or this trainer's kernels (softmax in fp32), "
        "not Megatron's fused softmax"
    ),
    (
        "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
        "--disable-jit-fuser --cross-entropy-fusion-impl "
        "--disable-clone-scatter-output-in-embedding --no-clone-scatter-output-in-embedding "
        "--cross-entropy-loss-fusion --no-gradient-accumulation-fusion --no-bias-dropout-fusion"
    ): "a fusion of Megatron's CUDA kernels: the layers here run PyTorch's",
    "--no-create-attention-mask-in-dataloader": "batches never carry an attention mask",
    (
        "--no-mmap-bin-files --dataloader-defer-npy-index-mmap --dataloader-fast-cache-load "
        "--num-dataset-builder-threads"
    ): "datasets are built once by Megatron-Core's builder and read memory-mapped",
    "--empty-unused-memory-level": "the CUDA cache is left to PyTorch's allocator",
    "--attention-backend": "the kernel is chosen per device and variant (model/kernels/kernels.py)",
    "--use-flash-attn": "flash-attn is used for standard attention whenever it is installed",
    (
        "--fp8-amax-history-len --fp8-amax-compute-algo --fp8-margin --fp8-interval "
        "--fp8-param-gather"
    ): "tunes fp8 (--fp8-format), which needs Transformer Engine",
    "--tiktoken-*": "read by Megatron's TikTokenizer only; tokenizers here are --tokenizer-type's",
    (
        "--tp-comm-* --no-tp-comm-* --disable-tp-comm-* --te-rng-tracker "
        "--use-te-activation-func --delay-wgrad-compute"
    ): f"tunes {TE} (tensor-parallel communication overlap, its kernels)",
    "--cuda-graph-* --enable-cuda-graph --external-cuda-graph": (
        "CUDA graphs are not captured here"
    ),
    (
        "--ddp-* --no-align-grad-reduce --no-align-param-gather "
        "--overlap-param-gather-with-optimizer-step --no-gradient-reduce-div-fusion "
        "--create-all-gather-group --use-nccl-ub --disable-symmetric-registration --use-sharp "
        "--sharp-enabled-group --high-priority-stream-groups --nccl-communicator-config-path "
        "--disable-gloo-process-groups --accumulate-allreduce-grads-in-fp32 "
        "--disable-async-tensor-model-parallel-allreduce "
        "--no-async-tensor-model-parallel-allreduce --distributed-timeout-seconds-after-init"
    ): (
        "tunes Megatron's data-parallel buckets and collectives; data parallelism here is "
        "DeepSpeed's (its gradients are accumulated in fp32, reduced in fp32 unless "
        "--grad-reduce-in-bf16)"
    ),
    (
        "--ckpt-fully-parallel-* --no-ckpt-fully-parallel-save "
        "--disable-ckpt-fully-parallel-save --ckpt-assume-constant-structure "
        "--dist-ckpt-strictness --dist-ckpt-optim-fully-reshardable "
        "--distrib-optim-fully-reshardable-mem-efficient --dist-ckpt-save-pre-mcore-014 "
        "--async-save --use-persistent-ckpt-worker --ckpt-convert-update-legacy-dist-opt-format "
        "--disable-strict-fsdp-dtensor-load --no-strict-fsdp-dtensor-load"
    ): (
        "tunes how Megatron-LM saves and loads distributed checkpoints (in parallel, "
        "asynchronously, reshardable); --ckpt-format torch_dist here saves with Megatron-Core's "
        "default strategy, synchronously"
    ),
    (
        "--use-cpu-initialization --init-model-with-meta-device --no-initialization "
        "--lazy-mpu-init --onnx-safe"
    ): "the model is initialised on its device once (a loaded checkpoint's weights replace that)",
    "--no-check-for-nan-in-loss-and-grad --rerun-mode": (
        "a non-finite loss is always caught: the step is skipped and the run stops after "
        "--max-skipped-steps in a row"
    ),
    (
        "--timing-log-level --timing-log-option --no-barrier-with-level-1-timing "
        "--tensorboard-queue-size --logging-level"
    ): (
        "the one timer here (iteration time) is rank 0's, logged at every level, and "
        "TensorBoard is written at each log step"
    ),
    "--local-rank": (
        "a process's device is its LOCAL_RANK environment variable (Megatron-LM's default for "
        "this flag), which torchrun and the deepspeed launcher set"
    ),
    "--no-one-logger --one-logger-* --app-tag-*": "NVIDIA's one-logger is not used",
    "--disable-msc": "Multi-Storage Client is not used: paths are local files",
    "--enable-experimental": "no experimental Megatron-Core feature is used",
    "--legacy-tokenizer --tokenizer-hf-use-fast --trust-remote-code": (
        "tokenizers here are --tokenizer-type's (HF tokenizers are read from tokenizer.json, "
        "fast, running no code)"
    ),
    "--disable-straggler-on-startup --straggler-*": (
        "tunes the straggler detector (--log-straggler), which is not used"
    ),
    "--no-data-sharding": "each data-parallel rank reads its own slice of every global batch",
}

# patterns: what is not offered, and what to use instead
REFUSED = {
    "--rl-* --grpo-* --langrl-* --perform-rl-step --refit-method": (
        "reinforcement learning (GRPO) is not supported: this trainer pretrains"
    ),
    (
        "--num-experts --expert-* --moe-* --overlap-moe-expert-parallel-comm "
        "--ep-overlap-early-attn-memory-release --use-fused-weighted-squared-relu"
    ): "mixture of experts is not supported (dense MLPs only)",
    (
        "--pipeline-model-parallel-size --pipeline-model-parallel-layout "
        "--num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank "
        "--account-for-*-in-pipeline-split --decoder-first-pipeline-num-layers "
        "--decoder-last-pipeline-num-layers --use-tp-pp-dp-mapping"
    ): "pipeline parallelism is not supported; use --zero-stage 3 or tensor parallelism",
    (
        "--fp8-* --no-fp8-wgrad --disable-fp8-wgrad --keep-fp8-transpose-cache "
        "--first-last-layers-bf16 --num-layers-at-*-in-bf16 --reuse-grad-buf-for-mxfp8-param-ag"
    ): FP8,
    "--fp4-*": f"fp4 needs {TE}; use --bf16",
    (
        "--use-precision-aware-optimizer --exp-avg-dtype --exp-avg-sq-dtype --main-grads-dtype "
        "--main-params-dtype --te-precision-config-file"
    ): f"lower-precision optimizer states need {TE}; the optimizer state is fp32 here",
    (
        "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim "
        "--qk-pos-emb-head-dim --v-head-dim --cache-mla-latents --mscale --mscale-all-dim "
        "--rope-type --rotary-scaling-factor"
    ): (
        "multi-latent attention (and its YaRN RoPE) is not supported; the attention here is "
        "--attention's (standard, XSA, Focus)"
    ),
    "--mtp-*": "multi-token prediction is not supported: the loss is the next token's",
    (
        "--experimental-attention-variant --dsa-indexer-* --linear-attention-freq --linear-* "
        "--attention-output-gate --softmax-type --qk-l2-norm --qk-clip* --window-attn-skip-freq "
        "--no-rope-freq --use-kitchen-attention --kitchen-attention-backend"
    ): (
        "this attention variant of Megatron-LM is not supported; the variants here are "
        "--attention's (standard, XSA, Focus; --window-size for a sliding window)"
    ),
    "--hierarchical-context-parallel-sizes --hybrid-context-parallel --max-seqlen-per-dp-cp-rank": (
        "context parallelism here is one level of ranks gathering keys and values "
        "(--context-parallel-size)"
    ),
    "--hybrid-* --is-hybrid-model --mamba-* --disable-mamba-mem-eff-path": (
        "hybrid Mamba models are not supported: every layer is a transformer layer"
    ),
    "--heterogeneous-layers-config-*": "every layer has the same configuration here",
    (
        "--bert-* --biencoder-* --ict-* --retriever-* --titles-data-path --evidence-data-path "
        "--block-data-path --embedding-path --indexer-* --query-in-block-prob "
        "--use-one-sent-docs --output-bert-embeddings --mask-prob --short-seq-prob --mask-factor "
        "--mask-type --vocab-extra-ids --relative-attention-* --img-* --patch-dim --num-channels "
        "--num-classes --classes-fraction --data-per-class-fraction --dino-* "
        "--swin-backbone-type --vision-* --iter-per-epoch --head-lr-mult --mrope-section "
        "--sample-rate"
    ): OTHER_MODELS,
    "--encoder-num-layers --decoder-num-layers": (
        "encoder-decoder models are not supported; use --num-layers"
    ),
    "--encoder-seq-length --decoder-seq-length": (
        "encoder-decoder models are not supported; use --seq-length"
    ),
    (
        "--inference-* --flash-decode --enable-chunked-prefill "
        "--disable-chunked-prefill --decode-only-cuda-graphs --max-tokens-to-oom "
        "--mlp-chunks-for-prefill --nccl-all-reduce-for-prefill --symmetric-ar-type "
        "--use-legacy-static-engine"
    ): (
        "Megatron's inference engine is not part of this trainer; export with "
        "tools/convert_to_hf.py and generate with Hugging Face"
    ),
    "--sft --sft-tokenizer-prompt-format": (
        "supervised fine-tuning datasets are not supported (--finetune continues pretraining "
        "from a checkpoint)"
    ),
    "--fim-*": "fill-in-the-middle samples are not supported",
    (
        "--enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters --inprocess-* "
        "--adlr-autoresume* --error-injection-* --result-rejected-tracker-filename "
        "--check-for-spiky-loss --check-for-large-grads --log-straggler "
        "--run-workload-inspector-server --fake-process-group"
    ): (
        "NVIDIA's fault-tolerance, in-process restart, straggler and result-checking services "
        "are not used; resume from checkpoints (--load, --exit-signal-handler, "
        "--exit-duration-in-mins)"
    ),
    (
        "--auto-detect-ckpt-format --ckpt-convert-* "
        "--non-persistent-* --replication* --load-main-params-from-ckpt --save-retain-interval "
        "--use-mp-args-from-checkpoint-args --no-use-tokenizer-model-from-checkpoint-args "
        "--disable-use-tokenizer-model-from-checkpoint-args"
    ): f"{CHECKPOINTS}, kept on disk as saved; convert with tools/convert_to_hf.py",
    (
        "--use-megatron-fsdp --use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward "
        "--data-parallel-sharding-strategy --outer-dp-sharding-strategy --fsdp-* "
        "--enable-full-sharding-in-hsdp --suggested-communication-unit-size "
        "--num-distributed-optimizer-instances"
    ): "FSDP is not used: ZeRO stage 3 shards the parameters (--zero-stage 3)",
    (
        "--optimizer-cpu-offload --optimizer-offload-fraction "
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-*"
    ): (
        "optimizer offload is DeepSpeed's here: set zero_optimization.offload_optimizer in "
        "--deepspeed_config"
    ),
    "--optimizer --sgd-momentum --muon-*": (
        "the optimizer is Adam with decoupled weight decay (--adam-beta1, --adam-beta2, "
        "--adam-eps, --weight-decay)"
    ),
    (
        "--lr-warmup-init --lr-wsd-* --start-weight-decay --end-weight-decay "
        "--weight-decay-incr-style"
    ): (
        "this schedule is not offered: the LR warms up from 0 (--lr-warmup-iters) and decays by "
        "--lr-decay-style; --weight-decay is constant"
    ),
    "--apply-wd-to-qk-layernorm --no-weight-decay-cond-type": (
        "weight decay skips biases and norms, as Megatron-LM's default"
    ),
    "--loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis": (
        "fp16 loss scaling is DeepSpeed's here: set fp16.loss_scale, initial_scale_power, "
        "loss_scale_window, hysteresis, min_loss_scale in --deepspeed_config"
    ),
    (
        "--fp32-residual-connection --fp16-lm-cross-entropy "
        "--disable-bf16-reduced-precision-matmul --deterministic-mode --batch-invariant-mode"
    ): (
        "this precision or determinism mode is not offered: the residual stream and the loss "
        "follow --bf16 / --fp16 as PyTorch computes them"
    ),
    (
        "--apply-residual-connection-post-layernorm --rotary-interleaved "
        "--rotary-seq-len-interpolation-factor --quick-geglu --glu-linear-offset "
        "--activation-func-clamp-value"
    ): (
        "this architecture option is not offered: pre-norm layers, RoPE on contiguous halves "
        "(--use-rope-scaling for Llama 3.1's scaling), GELU, --openai-gelu, --squared-relu or "
        "--swiglu"
    ),
    "--init-method-xavier-uniform --embedding-init-method-std --data-parallel-random-init": (
        "weights are initialised from --init-method-std and --seed, the same on every "
        "data-parallel rank"
    ),
    (
        "--recompute-modules --distribute-saved-activations --fine-grained-activation-offloading "
        "--offload-modules --min-offloaded-tensor-size --cpu-offloading-num-layers"
    ): (
        "recompute here: --recompute-activations (the core attention) or --recompute-granularity "
        "full; activations are not offloaded"
    ),
    "--padded-vocab-size": (
        "the vocabulary is padded from the tokenizer's (--make-vocab-size-divisible-by)"
    ),
    "--spec": "layer specs come from --attention (variants.py registers them)",
    "--use-legacy-models": "the model is Megatron-Core's GPTModel",
    "--batch-size": "replaced in Megatron-LM by --micro-batch-size",
    "--warmup": "replaced in Megatron-LM by --lr-warmup-iters",
    "--model-parallel-size": "replaced in Megatron-LM by --tensor-model-parallel-size",
    "--checkpoint-activations": "replaced in Megatron-LM by --recompute-activations",
    "--data-args-path --per-split-data-args-path --per-dataset-sequences-path": (
        "give the data on the command line (--data-path, or --train-data-path and "
        "--valid-data-path)"
    ),
    (
        "--dataloader-type --multiple-validation-sets --full-validation --iterations-to-skip "
        "--skip-train --phase-transition-iterations "
        "--mid-level-dataset-surplus --allow-ambiguous-pad-tokens --object-storage-cache-path "
        "--train-sync-interval --exit-signal-handler-for-dataloader"
    ): (
        "this data or loop option is not offered: one validation set, --eval-iters batches per "
        "evaluation, every iteration trained"
    ),
    (
        "--tokenizer-hf-include-special-tokens --tokenizer-metadata "
        "--tokenizer-sentencepiece-legacy --tokenizer-special-tokens"
    ): (
        "tokenizers here are --tokenizer-type's, as they come (SentencePiece, an HF "
        "tokenizer.json, GPT-2's BPE, NullTokenizer)"
    ),
    (
        "--log-progress --log-energy --log-device-memory-used --log-max-attention-logit "
        "--log-memory-interval --record-memory-history --memory-snapshot-path "
        "--config-logger-dir --dump-param-to-param-group-map --save-wgrads-interval "
        "--save-dgrads-interval --check-weight-hash-across-dp-replicas-interval --test-mode"
    ): (
        "this diagnostic is not written here (the logs: --log-throughput, --log-params-norm, "
        "--log-memory-to-tensorboard, --profile ...)"
    ),
    "--exit-signal": "the signal handler (--exit-signal-handler) catches SIGTERM and SIGINT",
    "--exit-on-missing-checkpoint": "a --load folder without a checkpoint starts a new run",
}
# Values besides Megatron-LM's default that are "off" (what this trainer does anyway).
ALSO_OFF = {
    "--dataloader-type": ("single",),
}

# Megatron-LM's other names for flags of this trainer: (this trainer's flag, why)
TRANSLATED = {
    "--use-rotary-position-embeddings": (
        "--position-embedding-type rope",
        "deprecated in Megatron-LM, which reads it so",
    ),
}
# Megatron-LM's tools/preprocess_data.py: its flags (its tokenizer flags are pretrain_gpt.py's,
# classified above), and what differs there from training.
PREPROCESS_SPEC = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "megatron_lm_preprocess_flags.txt"
)
PREPROCESS_NO_EFFECT = {
    "--vocab-extra-ids": (
        "Megatron-LM's preprocess_data.py sets it to 0 after parsing: it reaches no tokenizer "
        "there either"
    ),
    "--padded-vocab-size": (
        "the vocabulary is padded at training (--make-vocab-size-divisible-by); the .bin's dtype "
        "follows the tokenizer's own size, as in Megatron-LM"
    ),
}
# Megatron-LM's types that are functions of its own: the value is kept as text here.
TYPES = {"int": int, "float": float, "str": str}
ACTIONS = {"boolean_optional": argparse.BooleanOptionalAction}


@functools.lru_cache(maxsize=None)
def megatron_lm_actions(path: str = SPEC) -> List[Tuple[List[str], dict]]:
    """Megatron-LM's parser, one (flags, argparse keywords) per action, as recorded in `path`."""
    actions = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                flags, keywords = line.rstrip("\n").split("\t")
                actions.append((flags.split(), ast.literal_eval(keywords)))
    return actions


def megatron_flags(path: str = SPEC) -> list:
    """Every flag of Megatron-LM's `pretrain_gpt.py`, sorted."""
    return sorted(
        flag
        for flags, keywords in megatron_lm_actions(path)
        for name in flags
        for flag in (
            (name, f"--no-{name[2:]}") if keywords.get("action") == "boolean_optional" else (name,)
        )
        if flag.startswith("--")
    )


@functools.lru_cache(maxsize=None)
def classify(flag: str) -> Optional[Tuple[str, str]]:
    """("no effect" or "refused", why) for a Megatron-LM flag this trainer does not implement;
    None for one it implements (flags.py), which no family names."""
    return _classify(flag, (("no effect", NO_EFFECT), ("refused", REFUSED)))


@functools.lru_cache(maxsize=None)
def classify_preprocessing(flag: str) -> Optional[Tuple[str, str]]:
    """classify() for a flag of Megatron-LM's tools/preprocess_data.py: PREPROCESS_NO_EFFECT
    first; None for one tools/preprocess_data.py implements."""
    return _classify(flag, (("no effect", PREPROCESS_NO_EFFECT),)) or classify(flag)


def _classify(flag: str, tables) -> Optional[Tuple[str, str]]:
    """(kind, why) of the first family in `tables` ((kind, {patterns: why}), ...) naming flag."""
    for kind, table in tables:
        for patterns, why in table.items():
            if any(fnmatch.fnmatchcase(flag, p) for p in patterns.split()):
                return kind, why
    return None


def argparse_keywords(keywords: dict) -> dict:
    """Megatron-LM's keywords as argparse takes them here: its own type functions read text."""
    keywords = dict(keywords)
    if "action" in keywords:
        keywords["action"] = ACTIONS.get(keywords["action"], keywords["action"])
        keywords.pop("type", None)
    elif keywords.get("type") not in TYPES:
        keywords["type"] = str
        if keywords.get("default") is not None:
            keywords["default"] = str(keywords["default"])
    else:
        keywords["type"] = TYPES[keywords["type"]]
    return keywords


def _dest(flags: List[str], keywords: dict) -> str:
    return keywords.get("dest", flags[0][2:].replace("-", "_"))


def megatron_defaults(spec: str = SPEC) -> Dict[str, object]:
    """Each destination's value when no flag sets it: the first of its actions' default, as
    argparse keeps it (Megatron-LM's default)."""
    defaults: Dict[str, object] = {}
    for flags, keywords in megatron_lm_actions(spec):
        unset = keywords.get("action") == "store_false"  # store_true: False
        default = argparse_keywords(keywords).get("default", unset)
        defaults.setdefault(_dest(flags, keywords), default)
    return defaults


def off_values(flags: List[str], keywords: dict, defaults: Dict[str, object]) -> tuple:
    """The values of a refused flag that mean "off": its destination's default, and what
    ALSO_OFF adds."""
    off = [defaults[_dest(flags, keywords)], *ALSO_OFF.get(flags[0], ())]
    if keywords.get("nargs") in ("+", "*") and not isinstance(off[0], (list, type(None))):
        off.append([off[0]])  # Megatron-LM's scalar default of a list flag, as a script gives it
    return tuple(off)


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags done by DeepSpeed or named otherwise here, then every other one that
    `p` does not define, in its group: no effect, refused."""
    g = p.add_argument_group("Megatron-LM flags done by DeepSpeed")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Megatron's sharded optimizer state: ZeRO stage 1 (the default) or more",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="overlap gradient reduction with the backward pass (DeepSpeed's overlap_comm)",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="overlap parameter gathering with compute (DeepSpeed's overlap_comm)",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="reduce gradients across data-parallel ranks in bf16 (DeepSpeed's "
        "communication_data_type; fp32 otherwise)",
    )
    g = p.add_argument_group("Megatron-LM's other names for flags here")
    for flag, (ours, why) in TRANSLATED.items():
        g.add_argument(flag, action="store_true", help=f"{ours} ({why})")
    add_classified_args(p)


def add_classified_args(p: argparse.ArgumentParser, spec: str = SPEC, classify=classify) -> None:
    """Every flag of Megatron-LM's parser recorded in `spec` that `p` does not define, in its
    group (no effect, refused) as `classify` says, with Megatron-LM's keywords."""
    known = {o for action in p._actions for o in action.option_strings}
    groups = {
        "no effect": p.add_argument_group("Megatron-LM flags with no effect here"),
        "refused": p.add_argument_group(
            "Megatron-LM flags refused unless off (Megatron-LM's default)"
        ),
    }
    defaults = megatron_defaults(spec)
    for flags, keywords in megatron_lm_actions(spec):
        if known.intersection(flags):
            continue
        if classify(flags[0]) is None:
            raise KeyError(f"{flags[0]}: a Megatron-LM flag in no family of compat.py")
        kind, why = classify(flags[0])
        spec, keywords = keywords, argparse_keywords(keywords)
        if kind == "no effect":
            words = f"no effect: {why}"
        elif "action" in keywords:
            words = f"refused: {why}"
        else:
            off = " or ".join(
                "unset" if v is None else str(v) for v in off_values(flags, spec, defaults)
            )
            words = f"refused unless {off}: {why}"
        groups[kind].add_argument(*flags, help=words, **keywords)


def refusals(args: argparse.Namespace, spec: str = SPEC, classify=classify) -> Dict[str, List[str]]:
    """why -> the refused flags `args` gives at a value other than "off", as a user writes them.
    Flags that share a destination (Megatron-LM's old and new names) share their "off" values."""
    given: Dict[str, List[str]] = {}
    defaults, off, refused = megatron_defaults(spec), {}, {}
    for flags, keywords in megatron_lm_actions(spec):
        if (classify(flags[0]) or ("",))[0] == "refused":
            dest = _dest(flags, keywords)
            off.setdefault(dest, []).extend(off_values(flags, keywords, defaults))
            refused.setdefault(dest, flags[0])
    for dest, flag in refused.items():
        value = getattr(args, dest)
        if value not in off[dest]:
            shown = flag if isinstance(value, bool) else f"{flag} {_words(value)}"
            given.setdefault(classify(flag)[1], []).append(shown)
    return given


def _words(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def refuse(args: argparse.Namespace, spec: str = SPEC, classify=classify) -> None:
    """One error naming each refused flag that `args` gives, by feature (refusals())."""
    given = refusals(args, spec, classify)
    if given:
        raise ValueError("; ".join(f"{', '.join(flags)}: {why}" for why, flags in given.items()))


def check_compat_args(args: argparse.Namespace) -> None:
    """Refuse what is not offered, by feature and flag, in one message before anything is built."""
    refuse(args)
    if args.use_distributed_optimizer and args.zero_stage == 0:
        raise ValueError(
            "--use-distributed-optimizer shards the optimizer state: not with --zero-stage 0"
        )


def compat_table(megatron_flags: list, parser: argparse.ArgumentParser) -> str:
    """docs/megatron-compat.md: each of Megatron-LM's flags, as this trainer's parser takes it."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    rows, counts = [], {"yes": 0, "no effect": 0, "refused": 0}
    for flag in megatron_flags:
        help = (actions[flag].help or "").replace("%%", "%")
        # a --no-* form is as its flag is: refused with it, or no effect
        status = (classify(actions[flag].option_strings[0]) or ("yes",))[0]
        counts[status] += 1
        rows.append(f"| `{flag}` | {status} | {help.replace('|', '/')} |")
    ours = sorted(
        {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        - set(megatron_flags)
        - {"--help"}
    )
    return "\n".join(
        [
            "# Megatron-LM flags here",
            "",
            "Generated by `python tools/megatron_compat.py` from this trainer's own parser and "
            "Megatron-LM core_v0.16.1's `pretrain_gpt.py` parser as "
            "`megatron_focus/config/megatron_lm_flags.txt` records it; "
            "`tests/test_cli.py` checks that it is current. *yes*: does what Megatron-LM does "
            "(the note is `--help`'s); *no effect*: accepted, tunes something this trainer does "
            "not use; *refused*: stops the run before any compute, naming the feature and the "
            "alternative, unless given at the value that means off (Megatron-LM's default).",
            "",
            ", ".join(f"{n} {status}" for status, n in counts.items())
            + f" (of {len(megatron_flags)}).",
            "",
            "| Megatron-LM flag | Here | Note |",
            "|---|---|---|",
            *rows,
            "",
            "Flags of this trainer that Megatron-LM does not have: "
            + ", ".join(f"`{flag}`" for flag in ours)
            + ".",
            "",
        ]
    )
