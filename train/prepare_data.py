"""Build the tfds ArrayRecord text dataset and its BPE tokenizer (run once, before training).

``python -m train.prepare_data --data_dir /data/tfds --dataset phantom_wiki/articles_p400_s0 --vocab_size 4096``
"""
from __future__ import annotations


from rag_jax.data.text_tfds import prepare_text_dataset
from rag_jax.args import ScriptParser


def main(argv: list[str] | None = None) -> None:
    parser = ScriptParser(description=__doc__)
    parser.add_argument("--data_dir", required=True, help="tfds data folder")
    parser.add_argument("--dataset", default="phantom_wiki/articles_p60_s0",
                        help="phantom_wiki/articles or phantom_wiki/articles_p<people>_s<seed>")
    parser.add_argument("--vocab_size", type=int, default=512, help="BPE vocabulary size (<= model.vocab_size)")
    args = parser.parse_args(argv)
    path = prepare_text_dataset(args.dataset, args.data_dir, args.vocab_size)
    print(f"dataset {args.dataset} in {args.data_dir}; tokenizer {path}")


if __name__ == "__main__":
    main()
