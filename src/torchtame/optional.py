"""Optional dependencies (transformers, ray, ...): imported only when used, with an error that
names the extra to install when they are missing."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from .errors import TorchtameError

EXTRAS = {"transformers": "transformers", "ray": "ray", "timm": "timm", "torchao": "torchao"}


def require(module: str, what: str, error: type[TorchtameError] = TorchtameError) -> ModuleType:
    """Import ``module`` or raise ``error`` saying which extra provides it."""
    top = module.split(".")[0]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(top, top)
        raise error(
            f"{what} needs the optional package {top!r}, which is not installed ({exc})",
            hint=f"pip install 'torchtame[{extra}]'",
        ) from exc
    if top == "transformers":
        quiet_transformers()
    return mod


def quiet_transformers() -> None:
    """No download/loading progress bars and no advisory logs from transformers; torch's pytree
    module logs a deprecation line per enum when torchao is imported alongside, silenced too."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - only called after a successful import
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
