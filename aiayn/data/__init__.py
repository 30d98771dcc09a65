"""Data: tokenization, corpora, batching."""

from .batching import Batch, collate, lm_batches, lm_blocks, pad_batch, token_batches
from .corpus import (
    DataError,
    clean_pairs,
    describe_clean_stats,
    read_jsonl,
    read_jsonl_rows,
    read_lines,
    read_pairs,
    read_parallel,
    read_text,
    read_tsv,
)
from .datasets import (
    DATASETS,
    dataset_path,
    multi30k_split,
    tinyshakespeare_text,
    xsum_rows,
)
from .registry import config_pairs
from .tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerPair,
    TokenizerSpec,
    load_tokenizer,
    train_tokenizer,
    train_tokenizer_pair,
)

__all__ = [
    "BOS_ID", "DATASETS", "EOS_ID", "PAD_ID", "UNK_ID", "Batch", "CharTokenizer", "DataError",
    "SentencePieceTokenizer", "Tokenizer", "TokenizerPair", "TokenizerSpec", "clean_pairs", "collate", "config_pairs",
    "dataset_path", "describe_clean_stats", "lm_batches", "lm_blocks", "load_tokenizer", "multi30k_split",
    "pad_batch", "read_jsonl", "read_jsonl_rows", "read_lines", "read_pairs", "read_parallel", "read_text",
    "read_tsv", "tinyshakespeare_text", "token_batches", "train_tokenizer", "train_tokenizer_pair",
    "xsum_rows",
]
