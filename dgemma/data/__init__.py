"""Datasets for dgemma: the data sources of `sources` (local text, TFDS, Sudoku) behind one interface,
tokenized and packed by grain (pipeline.py), with SFT rows (sft.py).

  prepared = dgemma.data.prepare(settings)
  it = dgemma.data.make_iterator(settings, prepared, "train")
"""

from dgemma.data.pipeline import DataChanged, DataIterator, PreparedData
from dgemma.data.shakespeare import fetch_shakespeare
from dgemma.data.sources import SOURCES, make_iterator, prepare

__all__ = ["DataChanged", "DataIterator", "PreparedData", "SOURCES", "fetch_shakespeare", "make_iterator", "prepare"]
