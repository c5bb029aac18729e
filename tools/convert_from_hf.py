"""Import a Hugging Face model (Llama, Mistral, Qwen2, GPT-2, megatron_focus) as a checkpoint.

    python tools/convert_from_hf.py --hf-dir llama/ --save ckpt/ --tensor-model-parallel-size 2
    python pretrain_gpt.py <the printed model flags> --tensor-model-parallel-size 2 --load ckpt/ ...

The checkpoint holds weights only: the training run that loads it starts at iteration 0 with its
own optimizer and schedule. `--attention xsa` retrofits XSA (no new parameters). A sliding window
on every layer (Mistral's) imports as `--window-size`, Llama 3.1's RoPE scaling as
`--use-rope-scaling`. Models the native model cannot compute exactly are refused by what they
need: other RoPE scalings, a window on some layers only (Qwen2's `use_sliding_window`),
activations other than GELU, its tanh approximation, SwiGLU (and squared ReLU, in a
megatron_focus model), ...

`--attention focus` (or `focus+xsa`) retrofits Focus: the checkpoint is the base model (exactly an
import with `--attention standard`, or `xsa`), and the printed command is the retrofit run,
`pretrain_gpt.py ... --attention focus --retrofit --load CKPT`, which initialises the routers
afresh and trains only them (add `--focus-*` settings to it). An exported Focus model imports
with its routers.
"""

from megatron_focus import cli
from megatron_focus.variants import VARIANTS


def main() -> None:
    parser = cli.Parser(description=__doc__)
    parser.add_argument("--hf-dir", required=True, help="a folder written by save_pretrained")
    parser.add_argument("--save", required=True, help="the checkpoint folder to write")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument(
        "--attention", choices=VARIANTS, default=None, help="default: the HF model's own"
    )
    parser.add_argument(
        "--xsa-layers",
        type=int,
        nargs="+",
        default=None,
        help="with --attention xsa or focus+xsa: the layers (1-based) that use XSA",
    )
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument(
        "--flags-file",
        default=None,
        help="also write the model flags here, one per line (for scripts)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --save if it holds files (once the import is complete)",
    )
    args = parser.parse_args()
    from megatron_focus.hf import import_from_hf  # after parsing: --help stays fast

    flags = import_from_hf(
        args.hf_dir,
        args.save,
        args.tensor_model_parallel_size,
        args.attention,
        args.xsa_layers,
        args.make_vocab_size_divisible_by,
        overwrite=args.overwrite,
    )
    if args.flags_file:
        with open(args.flags_file, "w") as f:
            f.write("\n".join(flags) + "\n")
    what = "retrofit Focus onto it" if "--retrofit" in flags else "train from it"
    print(
        f"wrote {args.save}; {what} with\n  python pretrain_gpt.py {' '.join(flags)} "
        f"--tensor-model-parallel-size {args.tensor_model_parallel_size} --load {args.save} ..."
    )


if __name__ == "__main__":
    cli.run(main)
