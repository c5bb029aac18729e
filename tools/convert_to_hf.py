"""Export a megatron-focus checkpoint as a Hugging Face model folder.

    python tools/convert_to_hf.py --load ckpt/ --save-dir hf/ [--iteration 1000]

Any tensor-parallel size and ZeRO stage. Standard Llama-style models become `LlamaForCausalLM`,
GPT-2-style ones `GPT2LMHeadModel`; XSA, Focus and anything without an exact stock class become
`MegatronFocusForCausalLM`, loaded with `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`. The checkpoint's tokenizer is exported too.

A Focus model's routers and settings (recorded in the checkpoint) are exported; its inference
settings are not recorded: `--focus-top-k` and `--focus-attention-mode` set them in the HF config
(default 2 and soft), and `model.set_focus_mode("sparse", top_k=1)` (or
`model.config.focus_attention_mode = "sparse"`) changes them on the loaded model.

An attention variant that ships its HF layer (`hf_layer`, docs/extending.md) exports with that
layer's file and its recorded settings; one that names no HF layer is refused by name.
"""

from megatron_focus import cli
from megatron_focus.config.flags import add_unsafe_checkpoints_flag
from megatron_focus.data.choices import TOKENIZER_TYPES


def main() -> None:
    parser = cli.Parser(description=__doc__)
    parser.add_argument(
        "--load", required=True, help="checkpoint folder (as pretrain_gpt.py --save)"
    )
    parser.add_argument("--save-dir", required=True, help="the HF folder to write")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="with --tokenizer-model: instead of the tokenizer the checkpoint recorded",
    )
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument(
        "--max-shard-size", default="5GB", help="safetensors files above this size are split"
    )
    parser.add_argument(
        "--focus-top-k",
        type=int,
        default=None,
        help="Focus models: groups per query in sparse mode (default 2)",
    )
    parser.add_argument(
        "--focus-attention-mode",
        choices=("soft", "sparse"),
        default=None,
        help="Focus models: the mode the HF model starts in (default soft)",
    )
    add_unsafe_checkpoints_flag(parser)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --save-dir if it holds files (once the export is complete)",
    )
    args = parser.parse_args()
    from megatron_focus.hf import export_to_hf  # after parsing: --help stays fast

    name = export_to_hf(
        args.load,
        args.save_dir,
        args.iteration,
        args.tokenizer_type,
        args.tokenizer_model,
        args.max_shard_size,
        focus_top_k=args.focus_top_k,
        focus_attention_mode=args.focus_attention_mode,
        allow_unsafe=args.allow_unsafe_checkpoints,
        overwrite=args.overwrite,
    )
    print(f"wrote {name} to {args.save_dir}")


if __name__ == "__main__":
    cli.run(main)
