"""A tiny TFDS preference dataset, prepared as ArrayRecord in a folder, for the pair readers.

The builder is defined here, in a file, because TFDS reads a builder's metadata from the
folder of the module that defines it; a reader of the prepared folder needs none of it.
"""

from __future__ import annotations

import json
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


ROWS = {
    "train": [
        ("Tom has 3 apples and buys 4. How many?", "3 + 4 = <<3+4=7>>7\n#### 7"),
        (
            "A car costs $1,000 and a bike $80. Total?",
            "1000 + 80 = <<1000+80=1080>>1080\n#### 1,080",
        ),
        ("Half of 9?", "9 / 2 = <<9/2=4.5>>4.5\n#### 4.5"),
        ("Owed 5, paid 8. Balance?", "5 - 8 = -3\n#### -3"),
    ],
    "test": [
        ("2 times 21?", "2 * 21 = <<2*21=42>>42\n#### 42"),
        ("10 minus 1?", "10 - 1 = 9\n#### 9"),
    ],
}


def _write(folder, rows=ROWS):
    folder.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        with (folder / f"{split}.jsonl").open("w") as f:
            for q, a in items:
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return folder


def _prefill_tfds_download_cache(src, download_dir):
    """Puts the four files TFDS's gsm8k builder downloads into its cache, under its names."""
    from tensorflow_datasets.core.download import checksums, resource
    from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

    cache = download_dir / "gsm8k"
    cache.mkdir(parents=True)
    for name, url in tfds_gsm8k._URLS.items():
        path = cache / resource.get_dl_fname(url)
        path.write_bytes((src / f"{name.replace('_socratic', '')}.jsonl").read_bytes())
        resource.write_info_file(
            url=url,
            path=path,
            dataset_name="gsm8k",
            original_fname=f"{name}.jsonl",
            url_info=checksums.compute_url_info(path),
        )
