"""The Transformer of "Attention Is All You Need", section 3, one named module per idea."""

from aiayn.model.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.model.cache import KVCache
from aiayn.model.embeddings import TokenEmbedding, sinusoidal_table
from aiayn.model.layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward
from aiayn.model.positions import (
    LearnedPositionalEmbedding,
    Positions,
    PositionScheme,
    SinusoidalPositionalEncoding,
    position_scheme,
)
from aiayn.model.transformer import (
    Decoder,
    DecoderOnlyLM,
    Encoder,
    Transformer,
    build_model,
    causal_mask,
    count_parameters,
)

__all__ = [
    "Decoder", "DecoderLayer", "DecoderOnlyLM", "Encoder", "EncoderLayer", "KVCache",
    "LearnedPositionalEmbedding", "MultiHeadAttention", "PositionScheme", "Positions", "PositionwiseFeedForward",
    "SinusoidalPositionalEncoding", "TokenEmbedding", "Transformer", "build_model", "causal_mask",
    "count_parameters", "position_scheme", "scaled_dot_product_attention", "sinusoidal_table",
]
