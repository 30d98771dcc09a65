"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from training to deployment."""

from aiayn.config import Config, ModelConfig, load_config, model_config
from aiayn.model import DecoderOnlyLM, Transformer, build_model

__version__ = "0.1.0"

__all__ = ["Config", "DecoderOnlyLM", "ModelConfig", "Transformer", "build_model", "load", "load_config",
           "model_config"]


def load(run_dir, device: str = "cpu"):
    """A translator (or generator, for a language-model run) for a trained run directory."""
    from aiayn.decode.translator import load as _load

    return _load(run_dir, device=device)
