"""The encoder-decoder Transformer (section 3, Figure 1) and a decoder-only language model.

Shapes: B batch, S source length, T target length, D model width, V vocabulary.
Token masks are bool (B, S), True for real tokens; attention masks mean "may attend".
The models expose ``encode`` / ``decode`` (with an optional :class:`KVCache`) and nothing about search:
decoding algorithms live in :mod:`aiayn.search`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.engine import use_attention
from aiayn.linear import LinearKernel
from aiayn.model.attention import AttentionMask, padding_mask
from aiayn.model.cache import KVCache, StaticKVCache
from aiayn.model.embeddings import TokenEmbedding
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.model.positions import Positions, PositionScheme, position_scheme
from aiayn.task import task_named


def causal_mask(length: int, past: int = 0, device: torch.device | None = None) -> Tensor | None:
    """(length, past+length) bool: query i may attend to keys 0 .. past+i. None when nothing is hidden."""
    if length == 1:
        return None  # one new token sees every cached position
    q = torch.arange(length, device=device).unsqueeze(1) + past
    k = torch.arange(past + length, device=device).unsqueeze(0)
    return k <= q


def self_attention_mask(length: int, past: int, left_pad: Tensor | None, device: torch.device
                        ) -> tuple[AttentionMask | None, bool]:
    """What the decoder's ``length`` new queries may see after ``past`` cached steps, once for all layers: (mask,
    causal). ``causal`` (nothing cached, several steps, no left padding: training, prefill): the kernel's own
    causal path, no mask tensor. ``left_pad`` (B,): no query sees a padding column, and a padding query sees no key
    (its output is zero)."""
    causal = past == 0 and length > 1 and left_pad is None
    steps = None if causal else causal_mask(length, past, device)
    if left_pad is None:
        return (AttentionMask(steps, None) if steps is not None else None), causal  # a causal row always has a key
    keys = torch.arange(past + length, device=device)
    allowed = keys[None, None, None, :] >= left_pad[:, None, None, None]  # (B, 1, 1, past + T)
    if steps is not None:
        allowed = allowed & steps
    empty = ~allowed.any(dim=-1, keepdim=True)  # padding queries: no key at all
    return AttentionMask(allowed | empty, empty), False


class _Stack(nn.Module):
    """What the encoder and the decoder share: token embeddings and a :class:`PositionScheme`; the one place
    where positions meet the embeddings (section 3.5: "we add positional encodings to the input embeddings")."""

    embed: TokenEmbedding
    positions: PositionScheme
    dropout: nn.Dropout

    def inputs(self, tokens: Tensor, pos: Positions) -> Tensor:
        """tokens (B, T) -> Dropout(embeddings + the scheme's encodings) (B, T, D)."""
        x = self.positions.add(self.embed(tokens), pos)
        return self.dropout(x) if self.training else x


class Encoder(_Stack):
    """N encoder layers over scaled embeddings + positions (dropout on the sum)."""

    def __init__(self, cfg: ModelConfig, embed: TokenEmbedding) -> None:
        super().__init__()
        self.embed, self.positions = embed, position_scheme(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        # Pre-LN needs a final LayerNorm (its residual stream is never normalised); post-LN has none.
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(self, src: Tensor, src_mask: Tensor, need_weights: bool = False) -> tuple[Tensor, list]:
        """src (B, S) ids, src_mask (B, S) bool -> memory (B, S, D), per-layer attention probs."""
        pos = self.positions.at(src.size(1), device=src.device)  # sources are right-padded: 0 .. S-1 in every row
        x = self.inputs(src, pos)
        attn_mask = padding_mask(src_mask)  # (B, 1, 1, S): every query sees the real keys; once for all layers
        rotate = self.positions.rotation(pos)
        probs = []
        for layer in self.layers:
            x, p = layer(x, mask=attn_mask, need_weights=need_weights, rotate=rotate)
            probs.append(p)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, probs


class Decoder(LinearKernel, _Stack):
    """N decoder layers (masked self-attention, optional cross-attention, FFN) and the output projection."""

    def __init__(self, cfg: ModelConfig, embed: TokenEmbedding, cross_attention: bool = True) -> None:
        super().__init__()
        self.embed, self.positions = embed, position_scheme(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross_attention, i) for i in range(cfg.n_decoder_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None
        V = embed.weight.size(0)
        self.output_proj = nn.Linear(cfg.d_model, V, bias=False)
        if cfg.tie_output:
            self.output_proj.weight = embed.weight  # section 3.4: shared pre-softmax projection
        else:
            nn.init.xavier_uniform_(self.output_proj.weight)
        self.output_bias = nn.Parameter(torch.zeros(V)) if cfg.output_bias else None

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | StaticKVCache | None = None,
        need_weights: bool = False,
        left_pad: Tensor | None = None,
        project: bool = True,
    ) -> tuple[Tensor, list, list]:
        """tgt (B, T) ids (only the new steps when a cache is given); memory (B, S, D);
        memory_mask (B, S) bool. Returns logits (B, T, V), self- and cross-attention probs per layer; with
        ``project=False`` the states (B, T, D) the output projection would read instead of the logits (a loss that
        projects them itself, chunk by chunk: :meth:`output_projection`).

        ``left_pad`` (B,) long: row b's first left_pad[b] columns (from the first step) are padding, so that
        prompts of different lengths end together: its text starts at position 0 there, and no query sees a
        padding column (a padding query's output is zero). A :class:`StaticKVCache` takes one step (T = 1) at its
        device-side position, every shape fixed (a step recorded as a CUDA graph)."""
        T = tgt.size(1)
        if getattr(cache, "static", False):  # fixed shapes (a CUDA graph's step): the position is a device tensor
            pos = Positions(0, cache.capacity, cache.pos.expand(tgt.size(0), T))
            self_mask, causal = AttentionMask(cache.visible(), None), False
        else:
            past = cache.length if cache is not None else 0
            pos = self.positions.at(T, past, left_pad, tgt.device)  # once: the encodings and every layer's rotation
            self_mask, causal = self_attention_mask(T, past, left_pad, tgt.device)
        x = self.inputs(tgt, pos)
        mem_mask = padding_mask(memory_mask) if memory_mask is not None else None  # once for all layers
        self_probs, cross_probs = [], []
        rotate = self.positions.rotation(pos)
        for layer in self.layers:
            x, sp, cp = layer(x, self_mask=self_mask, memory=memory, memory_mask=mem_mask, cache=cache,
                              need_weights=need_weights, causal=causal, rotate=rotate)
            self_probs.append(sp)
            cross_probs.append(cp)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if not project:
            return x, self_probs, cross_probs
        logits = self.linear(x, self.output_proj.weight, self.output_bias)  # (B, T, V)
        return logits, self_probs, cross_probs

    def output_projection(self) -> tuple[Tensor, Tensor | None]:
        """The pre-softmax linear transformation (section 3.4): weight (V, D) (the tied embedding) and bias (V,) or
        None; logits = states @ weight.T + bias."""
        return self.output_proj.weight, self.output_bias


class Transformer(nn.Module):
    """Encoder-decoder Transformer: ``encode(src)`` once, then ``decode(tgt, memory)`` (teacher-forced
    or step by step with a cache). ``forward(src, tgt_in)`` returns logits (B, T, V)."""

    architecture = "encoder-decoder"  # the name a task builds it by (:data:`ARCHITECTURES`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pad_id = cfg.pad_id
        src_embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embeddings)
        if cfg.share_embeddings:
            tgt_embed = src_embed
        else:
            tgt_embed = TokenEmbedding(cfg.target_vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embeddings)
        self.encoder = Encoder(cfg, src_embed)
        self.decoder = Decoder(cfg, tgt_embed, cross_attention=True)

    @property
    def encoder_layers(self) -> int:
        """How many layers its encoder stacks."""
        return len(self.encoder.layers)

    def src_mask(self, src: Tensor) -> Tensor:
        """(B, S) ids -> (B, S) bool, True for real (non-pad) tokens."""
        return src != self.pad_id

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src (B, S) -> memory (B, S, D). ``src_mask`` defaults to ``src != pad_id``."""
        if src_mask is None:
            src_mask = self.src_mask(src)
        return self.encoder(src, src_mask)[0]

    def decode(
        self, tgt: Tensor, memory: Tensor, memory_mask: Tensor | None, cache: KVCache | None = None
    ) -> Tensor:
        """tgt (B, T) ids (with a cache: only the steps not yet cached); memory (B, S, D) and memory_mask (B, S)
        bool, or one row of each for every G consecutive rows of tgt ((B / G, S, D): beam search's beams share
        their sentence's); memory_mask None: no padding, every key seen. Returns logits (B, T, V)."""
        return self.decoder(tgt, memory, memory_mask, cache)[0]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for up to ``capacity`` decoding steps (its storage grows as they come)."""
        return KVCache(len(self.decoder.layers), capacity)

    def forward(self, src: Tensor, tgt_in: Tensor, src_mask: Tensor | None = None, project: bool = True) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) (BOS + target) -> logits (B, T, V); with ``project=False``
        the decoder's last states (B, T, D) instead (:meth:`Decoder.forward`)."""
        if src_mask is None:
            src_mask = self.src_mask(src)
        memory = self.encode(src, src_mask)
        return self.decoder(tgt_in, memory, src_mask, project=project)[0]

    @torch.no_grad()
    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Attention probabilities for inspection: {"encoder": (L, B, H, S, S), "decoder_self":
        (L, B, H, T, T), "cross": (L, B, H, T, S)} computed with the explicit attention path."""
        src_mask = self.src_mask(src)
        memory, enc = self.encoder(src, src_mask, need_weights=True)
        _, dec_self, cross = self.decoder(tgt_in, memory, src_mask, need_weights=True)
        return {"encoder": torch.stack(enc), "decoder_self": torch.stack(dec_self), "cross": torch.stack(cross)}


class DecoderOnlyLM(nn.Module):
    """An autoregressive language model: the decoder stack without cross-attention, tied output.

    Uses ``n_decoder_layers`` of the config. ``forward(tokens)`` returns logits (B, T, V).
    """

    architecture = "decoder-only"  # the name a task builds it by (:data:`ARCHITECTURES`)
    encoder_layers = 0  # it has no encoder

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pad_id = cfg.pad_id
        embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embeddings)
        self.decoder = Decoder(cfg, embed, cross_attention=False)

    def decode(
        self, tokens: Tensor, memory: Tensor | None = None, memory_mask: Tensor | None = None,
        cache: KVCache | None = None, left_pad: Tensor | None = None,
    ) -> Tensor:
        """tokens (B, T) (with a cache: only the new steps) -> logits (B, T, V). ``memory`` is unused;
        it is accepted so search code can drive both model kinds the same way. ``left_pad`` (B,): prompts of
        different lengths in one batch, left-padded (:meth:`Decoder.forward`)."""
        return self.decoder(tokens, None, None, cache, left_pad=left_pad)[0]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty :class:`KVCache` for up to ``capacity`` decoding steps (its storage grows as they come)."""
        return KVCache(len(self.decoder.layers), capacity)

    def forward(self, tokens: Tensor, project: bool = True) -> Tensor:
        """tokens (B, T) -> logits (B, T, V); with ``project=False`` the last states (B, T, D) instead."""
        return self.decoder(tokens, project=project)[0]

    @torch.no_grad()
    def attention_maps(self, tokens: Tensor) -> dict[str, Tensor]:
        """{"decoder_self": (L, B, H, T, T)} from the explicit attention path."""
        _, self_probs, _ = self.decoder(tokens, need_weights=True)
        return {"decoder_self": torch.stack(self_probs)}


# Each model class by its architecture, the name a task's runs build it by (:attr:`aiayn.task.Task.architecture`).
ARCHITECTURES: dict[str, type[Transformer | DecoderOnlyLM]] = {c.architecture: c for c in (Transformer, DecoderOnlyLM)}


def build_model(cfg: ModelConfig, task: str = "translation") -> nn.Module:
    """The model the runs of ``task`` build (:data:`ARCHITECTURES`): a :class:`Transformer` for translation and
    summarization, a :class:`DecoderOnlyLM` for ``lm``, with the engine's choice of attention computation per
    device (:func:`aiayn.engine.use_attention`). Whether it fits this machine is for the caller to ask first
    (:func:`aiayn.device.check_fits_in_memory`): the model knows no host."""
    return use_attention(ARCHITECTURES[task_named(task).architecture](cfg))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
