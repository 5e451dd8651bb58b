"""Data sources and the loaders they produce (see :mod:`torchtame.data.bundle`).

Importing this package registers the built-in sources.
"""

from __future__ import annotations

from ..registry import DATA_SOURCES, register_data_source
from . import sources, text  # noqa: F401  (registers the built-in sources)
from .bundle import DataBundle, Split, first_inputs, load_data
from .samples import Samples, split_sample
from .sources import (
    DigitsData,
    ImageFolderData,
    PythonData,
    SyntheticData,
    TorchvisionData,
    digits_tensors,
)
from .text import TextData

__all__ = [
    "DATA_SOURCES",
    "DataBundle",
    "DigitsData",
    "ImageFolderData",
    "PythonData",
    "Samples",
    "Split",
    "SyntheticData",
    "TextData",
    "TorchvisionData",
    "digits_tensors",
    "first_inputs",
    "load_data",
    "register_data_source",
    "split_sample",
]
