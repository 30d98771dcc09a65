"""Beam search on the CPU in one native loop (``native.cpp``): the decoder step, its key/value cache and the search's
bookkeeping without Python between a step's operations.

At batch 1 a Python beam step of the quick recipe's model is a few hundred small PyTorch operations, where its
arithmetic is a fraction of a millisecond (BENCHMARKS.md, "Where a CPU beam search's time goes"). The native loop runs
the same search with no Python between steps: products on weights packed once (blocks of 16 columns, each weight
vector read once per 8 rows, on the CPU's int8 or bf16 dot-product units where it has them), keys and values written
once per step and read through each beam's ancestors (a beam's reorder moves indices, not the cache), vectorized
attention, softmax and top-k, on T threads (torch's intra-op count): at least 2T sentences are T groups of sentences,
each searched by one thread (the caller's, and T - 1 started for the call, which end with it: no thread spins on a core
after the call), with no step waiting for another thread (a thread whose core is busy slows its own group only); fewer
sentences share each step's loops on torch's intra-op (OpenMP) threads. `python -m benchmarks.native_search` compares
the two searches by batch size: the native one is faster at every size measured (1 to 256 sentences), so it takes every
batch it supports.

What it computes is :func:`aiayn.search.beam.beam_search`'s search, the encoder included (candidates, finished pools,
stop rules, length penalties, banned ids, ``min_len``): the same hypotheses up to near-ties (sums in another order;
tests/test_native.py compares them). The products follow the model's linear kind (:mod:`aiayn.linear`): fp32;
bf16 (rows and weights rounded to bf16, fp32 sums: on the CPU's bf16 unit where it has AVX512-BF16); int8 (dynamic
int8 with :class:`aiayn.linear.Int8Linear`'s integer sums on AVX512-VNNI, else int8 weights and fp32 rows).
:func:`unsupported` says when the Python search runs instead: rotary positions, a decoder-only LM, n-gram blocking,
CUDA graphs, a device other than the CPU, a model in training mode or not in fp32, or no C++ compiler (said once,
as a warning).

The module is compiled on first use for the CPU it runs on (``-O3 -march=native -fopenmp``, through
``torch.utils.cpp_extension`` and ninja; ~35 s), into ``$AIAYN_NATIVE_DIR`` or ``cache_dir()/native``, under a key made
of the source, the CPU's model and flags, PyTorch and Python; later processes load it in well under a second.
``AIAYN_NATIVE=off`` turns it off (the Python search everywhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.cpu_probe import all_flags, cpu_model
from aiayn.files import atomic_write_text, cache_dir, file_lock
from aiayn.linear import linear_kind
from aiayn.model.positions import Positions, PositionScheme
from aiayn.search.spec import SearchSpec, SearchStopped, max_lengths
from aiayn.search.strategy import Hypothesis

log = logging.getLogger("aiayn.search")
SOURCE = Path(__file__).with_name("native.cpp")
ENV = "AIAYN_NATIVE"
PENALTIES = {"gnmt": 0, "power": 1, "none": 2}
STOPS = {"exact": 0, "hf": 1, "first": 2}
ACTIVATIONS = {"relu": 0, "gelu": 1, "swish": 2}
# the model's linear kind -> the native products' weights: fp32 (0), bf16 (1), int8 with a scale per row (2)
WEIGHTS = {"plain": 0, "packed": 0, "bf16": 1, "int8": 2, "int8_bf16": 2}

_module: Any = None
_why_not: str | None = None
_lock = threading.Lock()
# -fopenmp: at::parallel_for is OpenMP in PyTorch's CPU builds, and without the flag its pragma is dropped (one thread)
FLAGS = ("-O3", "-fopenmp")
DIR_ENV = "AIAYN_NATIVE_DIR"  # where compiled modules go (default: cache_dir()/native)


def build_key(arch: str = "native") -> str:
    """The compiled module's key: its source and flags, the CPU (for ``-march=native``) or ``arch``, PyTorch and
    Python."""
    parts = [SOURCE.read_text(), *FLAGS, arch, cpu_model(), all_flags(), torch.__version__, sys.version,
             platform.machine()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def build(arch: str = "native") -> Any:
    """Compile (or load, once compiled) the module for ``-march=arch`` (the CPU it runs on by default; tests build a
    narrower instruction set too, whose vector paths this CPU would not take); raises what the build raises.

    A finished build (its ``built`` marker written after the library) is loaded with no lock. A build is made under
    an ``flock`` on ``build.lock``, which the kernel releases when its holder dies however it dies: torch's own build
    lock (a ``lock`` file that every loading process took, even for a finished build) stayed behind when a process
    was killed while holding it, and every later process waited on it forever (a test's server, killed as it loaded
    the module, hung the servers and pytest runs after it on CI)."""
    out = Path(os.environ.get(DIR_ENV) or cache_dir() / "native") / build_key(arch)
    name = "aiayn_native_beam" if arch == "native" else f"aiayn_native_beam_{arch.replace('-', '_')}"
    marker, library = out / "built", out / f"{name}.so"
    if not (marker.exists() and library.exists()):
        out.mkdir(parents=True, exist_ok=True)
        with file_lock(out / "build.lock", doing=f"building {name}",
                       waiting=lambda pid: print(f"aiayn: waiting for pid {pid}, which builds the native beam search "
                                                 f"into {out}", file=sys.stderr, flush=True)):
            if not (marker.exists() and library.exists()):
                marker.unlink(missing_ok=True)  # a library removed since: built again
                print(f"aiayn: building the native beam search for this CPU into {out} (once, about 35 s)",
                      file=sys.stderr, flush=True)
                with contextlib.suppress(FileNotFoundError):
                    (out / "lock").unlink()  # torch's, left by a process killed in an earlier build: none holds it now
                from torch.utils.cpp_extension import load

                built = load(name=name, sources=[str(SOURCE)], build_directory=str(out),
                             extra_cflags=[*FLAGS, f"-march={arch}"], extra_ldflags=["-fopenmp"], verbose=False)
                atomic_write_text(marker, f"{name}\n")
                return built
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def module() -> Any | None:
    """The compiled module, built on first use (None when it cannot be: :func:`why_not` says why)."""
    global _module, _why_not
    with _lock:
        if _module is not None or _why_not is not None:
            return _module
        if os.environ.get(ENV, "").lower() in ("0", "off", "false", "no"):
            _why_not = f"{ENV}={os.environ[ENV]}"
        elif shutil.which("ninja") is None and not _pip_ninja():
            _why_not = "no ninja to build the native search (pip install ninja)"
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            _why_not = "no C++ compiler to build the native search"
        else:
            try:
                _module = build()
            except Exception as e:  # noqa: BLE001 - any build failure leaves the Python search, said once
                _why_not = f"the native search did not build ({type(e).__name__}: {str(e).strip().splitlines()[-1:]})"
        return _module


def _pip_ninja() -> bool:
    try:
        import ninja  # noqa: F401

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        return True
    except ImportError:
        return False


def why_not() -> str | None:
    """Why the native module is not there (after :func:`module` returned None)."""
    return _why_not


def chosen(model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec) -> bool:
    """Whether :func:`aiayn.search.beam.beam_search` runs this batch natively: right-padded sources that
    :func:`unsupported` accepts, where the module builds (once per process; a failure is said once). Sources the
    model cannot read (an id outside its vocabulary, more positions than it has) go to the PyTorch search, whose
    error says so: the native loop does not check its indices."""
    if unsupported(model, spec, src_mask.device) is not None:
        return False
    if src.numel() and (int(src.min()) < 0 or int(src.max()) >= model.encoder.embed.weight.size(0)
                        or src.size(1) > model.encoder.positions.max_positions):
        return False
    lengths = src_mask.sum(dim=1, keepdim=True)
    if not torch.equal(src_mask, torch.arange(src_mask.size(1), device=src_mask.device) < lengths):
        return False  # not right-padded (the native cross-attention reads each source's first tokens)
    if module() is None:
        if not _told:
            _told.append(True)
            warnings.warn(f"beam search runs in Python: {_why_not}", RuntimeWarning, stacklevel=3)
        return False
    if not _told:  # said once a process, with `aiayn -v`
        _told.append(True)
        m = module()
        units = [name for name, have in (("AVX512-VNNI int8", m.vnni), ("AVX512-BF16", m.dpbf16)) if have]
        log.debug("beam search: the native loop (built for this CPU%s)", f": {', '.join(units)}" if units else "")
    return True


_told: list[bool] = []


def unsupported(model: nn.Module, spec: SearchSpec, device: torch.device) -> str | None:
    """Why the native search cannot run this search (None: it can, the module aside)."""
    o = spec.options
    if device.type != "cpu":
        return f"the native search runs on the CPU, not {device.type}"
    if getattr(model, "architecture", None) != "encoder-decoder":
        return "the native search covers the encoder-decoder"
    if model.training:
        return "the model is in training mode"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on"
    if o.cuda_graphs or o.no_repeat_ngram > 0:
        return "n-gram blocking and CUDA graphs run in the Python search"
    kind = linear_kind(model)
    if kind not in WEIGHTS:
        return f"the native search has no {kind} products"
    dec = model.decoder
    if type(dec.positions).rotation is not PositionScheme.rotation:
        return "the native search adds positions; rotary positions rotate"
    if model.cfg.activation not in ACTIVATIONS:
        return f"no native {model.cfg.activation}"
    if dec.output_proj.weight.size(0) < 2 * o.beam:
        return "a vocabulary smaller than twice the beam"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "the native search takes fp32 weights"
    return None


# Each model's native decoder and the state of the parameters it was made from (kept beside the model, not on it:
# a model stays copyable and picklable).
_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(model: nn.Module) -> tuple:
    return tuple((id(p), p._version) for p in model.parameters()) + (linear_kind(model),)


def decoder(model: nn.Module) -> Any:
    """The native decoder of ``model``: its weights prepared once (fp32, or bf16 where its products are bf16), and
    again after the parameters change (training between validations)."""
    state = _state(model)
    held = _decoders.get(model)
    if held is not None and held[0] == state:
        return held[1]
    cfg, dec = model.cfg, model.decoder
    D = cfg.d_model
    P = dec.positions.max_positions
    pe = dec.positions.encodings(Positions(0, P))
    empty = torch.empty(0)
    tensors: list[Tensor] = [dec.embed.weight.detach(), (pe if pe is not None else torch.zeros(P, D)).detach()]
    for layer in dec.layers:
        sa, ca, ffn = layer.self_attn, layer.cross_attn, layer.ffn
        qk = sa._rows[0]
        tensors += [layer.sub_self.norm.weight, layer.sub_self.norm.bias, sa.in_proj.weight, sa.in_proj.bias,
                    sa.out_proj.weight, sa.out_proj.bias,
                    layer.sub_cross.norm.weight, layer.sub_cross.norm.bias, ca.in_proj.weight[:qk],
                    ca.in_proj.bias[:qk], ca.out_proj.weight, ca.out_proj.bias,
                    layer.sub_ffn.norm.weight, layer.sub_ffn.norm.bias, ffn.fc1.weight, ffn.fc1.bias,
                    ffn.fc2.weight, ffn.fc2.bias]
    final = dec.final_norm
    tensors += [final.weight if final is not None else empty, final.bias if final is not None else empty]
    w, b = dec.output_projection()
    tensors += [w, b if b is not None else empty]
    enc = model.encoder
    pe = enc.positions.encodings(Positions(0, enc.positions.max_positions))
    tensors += [enc.embed.weight, pe if pe is not None else torch.zeros(enc.positions.max_positions, D)]
    for layer in enc.layers:
        sa, ffn = layer.self_attn, layer.ffn
        tensors += [layer.sub_attn.norm.weight, layer.sub_attn.norm.bias, sa.in_proj.weight, sa.in_proj.bias,
                    sa.out_proj.weight, sa.out_proj.bias, layer.sub_ffn.norm.weight, layer.sub_ffn.norm.bias,
                    ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias]
    final = enc.final_norm
    tensors += [final.weight if final is not None else empty, final.bias if final is not None else empty]
    for layer in dec.layers:  # the K | V rows of each cross-attention, which project the encoder's output
        ca = layer.cross_attn
        tensors += [ca.in_proj.weight[ca._rows[0]:], ca.in_proj.bias[ca._rows[0]:]]
    tensors = [t.detach() for t in tensors]
    sa = dec.layers[0].self_attn
    ints = [D, sa.n_heads, sa.d_k, sa.d_v, len(dec.layers), int(not cfg.norm_first), ACTIVATIONS[cfg.activation],
            WEIGHTS[linear_kind(model)], len(enc.layers)]
    native = module().Decoder(tensors, ints, [float(cfg.layer_norm_eps), float(dec.embed.scale)])
    _decoders[model] = (state, native)
    return native


@torch.no_grad()
def beam_search(model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec,
                groups: int = 0) -> list[list[Hypothesis]]:
    """:func:`aiayn.search.beam.beam_search` in the native loop, the encoder included (the caller has checked
    :func:`unsupported` and :func:`module`). src (B, S) ids, src_mask (B, S) bool, each row's real ids first.
    ``groups``: the sentences' groups, each searched by one thread (0: the module's choice, ``group_count``; tests
    and benchmarks set it)."""
    o = spec.options
    lengths = src_mask.sum(dim=1).tolist()
    limits = max_lengths(model, src_mask, spec, lengths)
    how = [o.beam, o.nbest, PENALTIES[o.length_penalty], STOPS[o.stop], spec.bos, spec.eos, o.min_len, groups]
    ids = src.masked_fill(~src_mask, 0).reshape(-1).tolist()  # the encoder reads each source's first ids only
    results, stopped = decoder(model).search(ids, lengths, limits, how, float(o.alpha), list(spec.banned), spec.stop)
    if stopped:
        raise SearchStopped("the search was stopped by its caller")
    return [[Hypothesis(list(tokens), score, logprob) for tokens, score, logprob in sent] for sent in results]


__all__ = ["beam_search", "build", "build_key", "chosen", "decoder", "module", "unsupported",
           "why_not"]
