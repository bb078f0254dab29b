"""GSM8K (Cobbe et al. 2021) through tensorflow-datasets, online or from local JSONL.

Each example is ``{"prompt": question, "answer": "18", "solution": ...}``, the solution the
reference reasoning rewritten as ``<think>...</think>\\n<answer>18</answer>``. Two routes,
both read with ``tfds.data_source`` from ArrayRecord files (no TensorFlow): TFDS's own
``gsm8k`` builder (online, or a ``data_dir`` prepared once and copied), or ``jsonl_dir``'s
GSM8K-format files prepared by the ``gsm8k_local`` builder below (docs/data.md, "GSM8K
through tensorflow-datasets").
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

from grpo_jax.core.errors import ConfigError
from grpo_jax.data.jsonl import MalformedRowError, iter_rows, read_jsonl, row_problem
from grpo_jax.rewards.extract import format_number, normalize_number

LOCAL_NAME = "gsm8k_local"
_FINGERPRINT_FILE = "grpo_jax_sources.json"
_CALC_RE = re.compile(r"<<[^<>]*>>")


def parse_reference(answer_text: str) -> tuple[str, str]:
    """GSM8K reference ``"reasoning\\n#### 1,080"`` -> (reasoning, "1080").

    Raises ValueError when there is no ``####`` or no number after it.
    """
    if "####" not in answer_text:
        raise ValueError("answer has no '####' final-answer marker")
    reasoning, final = answer_text.rsplit("####", 1)
    value = normalize_number(final)
    if value is None:
        raise ValueError(f"no number after '####' (got {final.strip()!r})")
    return _CALC_RE.sub("", reasoning).strip(), format_number(value)


def make_solution(reasoning: str, answer: str) -> str:
    """Worked solution in the format the rewards check."""
    return f"<think>\n{reasoning}\n</think>\n<answer>{answer}</answer>"


def to_example(question: str, answer_text: str) -> dict:
    """One GSM8K row -> ``{"prompt", "answer", "solution"}``."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question {question!r} is not non-empty text")
    if not isinstance(answer_text, str):
        raise ValueError(f"answer {answer_text!r} is not text")
    reasoning, answer = parse_reference(answer_text)
    return {
        "prompt": question.strip(),
        "answer": answer,
        "solution": make_solution(reasoning, answer),
    }


def _convert_row(row: dict) -> dict:
    for key in ("question", "answer"):
        if key not in row:
            raise ValueError(f"missing field {key!r} (row has {sorted(row)})")
    return to_example(row["question"], row["answer"])


def read_gsm8k_jsonl(path, *, on_error: str = "raise") -> tuple[list[dict], list[int]]:
    """A GSM8K-format JSONL file -> (examples, skipped line numbers), without TFDS."""
    return read_jsonl(path, on_error=on_error, convert=_convert_row)


def _tfds():
    try:
        import tensorflow_datasets as tfds
        import tensorflow_datasets.text  # noqa: F401 -- registers gsm8k without a catalog lookup
    except ImportError as e:
        raise ImportError(
            f"GSM8K through TFDS needs tensorflow-datasets and array-record ({e}); "
            "pip install -r requirements.txt"
        ) from e
    return tfds


_LOCAL_CLS = None


def local_builder_class():
    """The ``gsm8k_local`` TFDS builder (defined, hence registered, on first call)."""
    global _LOCAL_CLS
    if _LOCAL_CLS is not None:
        return _LOCAL_CLS
    tfds = _tfds()
    from tensorflow_datasets.text.gsm8k.gsm8k import Gsm8k

    class Gsm8kLocal(Gsm8k):
        """TFDS's gsm8k builder reading ``<split>.jsonl`` files from the manual dir."""

        MANUAL_DOWNLOAD_INSTRUCTIONS = (
            "Put GSM8K-format files train.jsonl and/or test.jsonl (one "
            '{"question": ..., "answer": "... #### <number>"} per line) in the manual dir.'
        )

        def _split_generators(self, dl_manager):
            files = sorted(pathlib.Path(dl_manager.manual_dir).glob("*.jsonl"))
            if not files:
                raise FileNotFoundError(f"no *.jsonl files in {dl_manager.manual_dir}")
            return {f.stem: self._generate_examples(f) for f in files}

        def _generate_examples(self, path):
            # The upstream generator's errors name neither file nor line.
            for lineno, row in _iter_checked(path):
                annotation, short = row["answer"].rsplit("#### ", 1)
                yield lineno, {**row, "annotation": annotation, "short_answer": short}

    del tfds
    _LOCAL_CLS = Gsm8kLocal
    return _LOCAL_CLS


def _iter_checked(path):
    """(line, row) of a GSM8K-format JSONL file; a malformed row raises MalformedRowError."""
    for lineno, row in iter_rows(path):
        try:
            problem = row_problem(row)
            if problem is not None:
                raise ValueError(problem)
            _convert_row(row)
            if "#### " not in row["answer"]:
                raise ValueError("answer has no '#### ' final-answer marker")
        except ValueError as e:
            raise MalformedRowError(path, lineno, str(e)) from None
        yield lineno, {"question": row["question"], "answer": row["answer"]}


def _fingerprint(jsonl_dir: pathlib.Path) -> dict:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(jsonl_dir.glob("*.jsonl"))
    }


def prepare_local(jsonl_dir, data_dir=None):
    """Prepares ``gsm8k_local`` from the JSONL files in ``jsonl_dir`` (once) -> builder.

    A ``data_dir`` already prepared from different files raises ValueError
    rather than silently serving stale data.
    """
    tfds = _tfds()
    jsonl_dir = pathlib.Path(jsonl_dir).expanduser()
    if not jsonl_dir.is_dir() or not any(jsonl_dir.glob("*.jsonl")):
        raise FileNotFoundError(f"GSM8K jsonl_dir {jsonl_dir} has no *.jsonl files")
    builder = local_builder_class()(data_dir=None if data_dir is None else str(data_dir))
    stamp = pathlib.Path(builder.data_dir) / _FINGERPRINT_FILE
    want = _fingerprint(jsonl_dir)
    if builder.is_prepared():
        have = json.loads(stamp.read_text()) if stamp.exists() else None
        if have != want:
            raise ValueError(
                f"{builder.data_dir} was prepared from other GSM8K files than those in "
                f"{jsonl_dir}; delete it or choose another data_dir"
            )
        return builder
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=str(jsonl_dir)),
    )
    stamp.write_text(json.dumps(want, indent=1))
    return builder


DOWNLOAD_HOST = ("raw.githubusercontent.com", 443)


def network_reachable(host: tuple[str, int] = DOWNLOAD_HOST, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host`` (or to the HTTPS proxy, when one is set) opens.

    Bounded by ``timeout`` seconds in all, name resolution included: the
    attempt runs in a daemon thread that is abandoned when it takes longer.
    """
    import socket
    import threading
    import urllib.parse
    import urllib.request

    proxy = urllib.request.getproxies().get("https")
    if proxy:
        parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if parsed.hostname:
            host = (parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80))
    result = []

    def attempt():
        try:
            socket.create_connection(host, timeout=timeout).close()
            result.append(True)
        except Exception:  # Any failure to connect means no download.
            result.append(False)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def download_cached(data_dir=None) -> bool:
    """Whether TFDS's download cache in ``data_dir`` already holds the files gsm8k downloads.

    TFDS then prepares ``gsm8k`` from that cache with no network. When TFDS's
    cache layout cannot be inspected, True: TFDS is left to decide.
    """
    try:
        from tensorflow_datasets.core.download import resource
        from tensorflow_datasets.text.gsm8k.gsm8k import _URLS

        root = pathlib.Path(_tfds().core.constants.DATA_DIR if data_dir is None else data_dir)
        downloads = root.expanduser() / "downloads"
        return all(
            any(
                resource.is_locally_cached(folder / resource.get_dl_fname(url))
                for folder in (downloads / "gsm8k", downloads)
            )
            for url in _URLS.values()
        )
    except (ImportError, AttributeError):
        return True


def prepare_online(data_dir=None):
    """Downloads and prepares TFDS's ``gsm8k`` in ``data_dir`` (once) -> builder.

    Where it is not prepared, its files are not in TFDS's download cache and
    the download host cannot be reached (:func:`network_reachable`), raises
    ConfigError within seconds, pointing to the offline route, rather than
    letting TFDS retry the download for minutes.
    """
    tfds = _tfds()
    builder = tfds.builder("gsm8k", data_dir=None if data_dir is None else str(data_dir))
    if not builder.is_prepared():
        root = builder.data_dir_root
        if not download_cached(root) and not network_reachable():
            raise ConfigError(
                f"GSM8K is not prepared in {root} and it cannot be downloaded here (no "
                "network): put GSM8K's train.jsonl/test.jsonl in a folder and set "
                "data.jsonl_dir=<folder> (docs/data.md); or set data.data_dir to a copy of "
                "a TFDS data_dir where gsm8k was prepared"
            )
        try:
            builder.download_and_prepare(file_format="array_record")
        except Exception as e:
            raise RuntimeError(
                f"could not download and prepare GSM8K in {root} ({e}). "
                "With no network, put GSM8K's train.jsonl/test.jsonl in a folder and set "
                "data.jsonl_dir=<folder> (docs/data.md)"
            ) from e
    return builder


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def load(split: str, *, data_dir=None, jsonl_dir=None) -> list[dict]:
    """GSM8K ``split`` as example dicts, read with ``tfds.data_source``.

    Args:
      split: "train" or "test" (any split the prepared data has; TFDS slices
        such as "train[:100]" work too).
      data_dir: TFDS data dir (default: TFDS's, ~/tensorflow_datasets).
      jsonl_dir: offline route: a folder of GSM8K-format ``<split>.jsonl``
        files, prepared once as ``gsm8k_local`` in ``data_dir``. Without it,
        TFDS's ``gsm8k`` is used (downloaded when not yet prepared).
    """
    tfds = _tfds()
    if jsonl_dir is not None:
        builder = prepare_local(jsonl_dir, data_dir)
    else:
        builder = prepare_online(data_dir)
    base = split.split("[", 1)[0]
    if base not in builder.info.splits:
        raise ValueError(
            f"GSM8K split {base!r} not found in {builder.data_dir}; "
            f"available splits: {sorted(builder.info.splits)}"
        )
    source = tfds.data_source(
        builder.name, split=split, data_dir=builder.data_dir_root, download=False
    )
    rows = source.__getitems__(range(len(source))) if len(source) else []
    return [to_example(_text(r["question"]), _text(r["answer"])) for r in rows]
