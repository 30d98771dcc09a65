"""Decoding on token ids: greedy, batched beam search with length penalties by name, and sampling.

Nothing here knows about text or runs. A search reads one :class:`SearchSpec` (the decoding options and the
special ids, built once per call), applies one per-step logits processing (:mod:`.processing`), and drives any
model exposing

    memory = model.encode(src (B, S), src_mask (B, S) bool)          -> (B, S, D)
    logits = model.decode(tgt (B, T), memory, memory_mask, cache)    -> (B, T, V)
    cache  = model.new_cache();  cache.reorder(rows: LongTensor)     (select / repeat / drop rows)
    cache.reserve(steps)                                             (optional: preallocate decoding steps)

With a cache, ``decode`` receives only the tokens it has not seen yet; ``memory_mask`` None means no padding
(beam search passes None where no source is padded, so that no step applies a mask that hides nothing). A
decoder-only LM takes ``memory=None, memory_mask=None`` (only :func:`sample` uses one). :func:`decode_ids` is
the one "decode these sources" that the translator, training's validation BLEU and the attention explorer share.

Shapes: B batch (sentences), S source length, T target length, D model width, V vocabulary, N beam size; rows
of beam search are sentence-major: row = sentence * N + beam.

Conventions shared by every search:

* The output never contains BOS or EOS. The decoder starts from the spec's ``bos`` (the special ids'
  ``decoder_start``: Hugging Face Marian starts from its pad id, aiayn models from BOS).
* ``max_len`` of sentence i is ``int(max_len_a * src_len_i + max_len_b)`` with ``src_len_i`` its real
  (non-pad) length, so batching never changes a sentence's limit; it is capped at the model's
  ``cfg.max_positions`` (the decoder reads positions 0 .. max_len-1). ``max_len`` bounds the number of
  *decoding steps*: EOS is one of them. A sentence ended by EOS has at most max_len-1 tokens; one still
  running at step max_len is cut there and returned with exactly max_len tokens and no EOS, as Hugging
  Face finalizes unfinished beams (fairseq instead forces an EOS after max_len tokens). Hugging Face's
  ``max_length`` counts the start token as well: ``max_length = max_len + 1``.
* ``min_len``: EOS is forbidden until ``min_len`` tokens have been produced (HF ``min_length - 1``).
* ``|Y|``, the length in the length penalty, is the number of decoding steps of the hypothesis: its
  tokens **plus the EOS** when it ended with one (a hypothesis cut at max_len has |Y| = max_len). This
  is Hugging Face's ``cur_len + 1 - decoder_prompt_len`` and fairseq's ``step + 1``.

Models are not switched to eval mode here: callers decode with ``model.eval()`` (dropout off).
"""

from aiayn.device import model_device
from aiayn.search.beam import Beam, beam_search
from aiayn.search.common import (
    LENGTH_PENALTIES,
    NEG_INF,
    STOP_RULES,
    length_penalty_denominator,
    penalized_score,
)
from aiayn.search.greedy import Greedy, greedy_search, score_tokens
from aiayn.search.processing import LogitsProcessor, filter_top_k, filter_top_p, repeated_ngram_bans
from aiayn.search.sampling import Sampling, sample, sample_list, sample_rows, sample_search
from aiayn.search.sources import STRATEGIES, decode_batches, decode_ids, rows_per_source, search_batch, strategy_for
from aiayn.search.spec import SearchSpec, SearchStopped, max_lengths
from aiayn.search.strategy import Hypothesis, Strategy

__all__ = [
    "LENGTH_PENALTIES", "NEG_INF", "STOP_RULES", "STRATEGIES", "Beam", "Greedy", "Hypothesis", "LogitsProcessor",
    "Sampling", "SearchSpec", "SearchStopped", "Strategy", "beam_search", "rows_per_source", "strategy_for",
    "decode_batches", "decode_ids", "filter_top_k", "filter_top_p", "greedy_search", "length_penalty_denominator",
    "max_lengths", "model_device", "penalized_score", "repeated_ngram_bans", "sample", "sample_list", "sample_rows",
    "sample_search", "score_tokens", "search_batch",
]
