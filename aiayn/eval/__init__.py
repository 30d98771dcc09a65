"""Metrics: sacreBLEU, chrF, tokenized BLEU, ROUGE, perplexity."""
