"""Datasets for dgemma: local text or TFDS, tokenized and packed by grain (see pipeline.py)."""

from dgemma.data.pipeline import (DataIterator, PreparedData, make_iterator, prepare,
                                  validate_data_config)
from dgemma.data.shakespeare import fetch_shakespeare

__all__ = ["DataIterator", "PreparedData", "fetch_shakespeare", "make_iterator", "prepare",
           "validate_data_config"]
