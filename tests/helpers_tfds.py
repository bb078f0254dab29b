"""A tiny TFDS preference dataset, prepared as ArrayRecord in a folder, for the pair readers.

The builder is defined here, in a file, because TFDS reads a builder's metadata from the
folder of the module that defines it; a reader of the prepared folder needs none of it.
"""

from __future__ import annotations

import pathlib

import numpy as np

NAME = "tiny_prefs"
FIELDS = ("question", "response_j", "response_k")  # named as in many preference sets


def rows(n: int) -> list[dict]:
    """``n`` rows: a question, a preferred and a dispreferred answer, and a score (an int)."""
    return [
        {
            "question": f"{i}+{i}=",
            "response_j": str(2 * i),
            "response_k": str(2 * i + 1),
            "score": i,
        }
        for i in range(n)
    ]


_BUILDER = None
TRAIN, TEST = 12, 4


def prepare(data_dir: pathlib.Path) -> pathlib.Path:
    """Prepares ``tiny_prefs`` (TRAIN rows in "train", TEST in "test") in ``data_dir``."""
    _builder()(data_dir=str(data_dir)).download_and_prepare(file_format="array_record")
    return data_dir


def _builder():
    """The builder class, defined (and so registered with TFDS) once, on first use."""
    global _BUILDER
    if _BUILDER is not None:
        return _BUILDER
    import tensorflow_datasets as tfds

    class TinyPrefs(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            text = tfds.features.Text()
            features = {f: text for f in FIELDS} | {"score": tfds.features.Scalar(np.int32)}
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict(features)
            )

        def _split_generators(self, dl_manager):
            del dl_manager
            every = rows(TRAIN + TEST)
            return {
                "train": self._generate_examples(every[:TRAIN]),
                "test": self._generate_examples(every[TRAIN:]),
            }

        def _generate_examples(self, split_rows):
            yield from enumerate(split_rows)

    assert TinyPrefs.name == NAME
    _BUILDER = TinyPrefs
    return _BUILDER
