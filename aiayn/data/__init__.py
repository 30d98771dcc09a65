"""Data: tokenization, corpora, batching."""
