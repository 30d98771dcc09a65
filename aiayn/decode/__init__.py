"""Decoding on token ids (search) and text in / text out (translator)."""
