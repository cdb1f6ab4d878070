"""A small, naturally ragged supervised corpus built from the Python standard library's own source.

Every function in the installed standard library that has a docstring becomes one prompt/response pair: the prompt
is the ``def`` signature plus the docstring, the response is the body that follows. Nothing is downloaded; the files
are located with ``sysconfig``. Response lengths vary from one-line getters to long parsers, so the number of target
tokens per sample (and therefore per micro-batch) is ragged for real, not by construction, which is exactly the
situation where averaging per-micro-batch means gives the wrong loss.

Tokenization is byte-level: ids 0-255 are the UTF-8 bytes, plus ``PAD``, ``BOS`` and ``EOS``. Only the response
bytes and the closing ``EOS`` are targets; prompt and padding positions carry the label ``-100``.

Example:
    >>> pairs = load_pairs(limit=200)
    >>> train, val = train_val_split(pairs)
    >>> loader = torch.utils.data.DataLoader(PairDataset(train), batch_size=8, collate_fn=collate)
"""

from __future__ import annotations

import ast
import contextlib
import gc
import json
import os
import random
import sysconfig
import textwrap
import tokenize
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor
from torch.utils.data import Dataset

PAD = 256
BOS = 257
EOS = 258
VOCAB_SIZE = 259
IGNORE_INDEX = -100
"""The label ``F.cross_entropy(..., ignore_index=-100)`` skips, and the strategy's default count excludes."""

MAX_LEN = 640
"""Longest ``input_ids`` a sample can have; matches ``LMConfig.max_len`` in ``tiny_lm``."""
MAX_PROMPT_BYTES = 256
MAX_RESPONSE_BYTES = MAX_LEN - 1 - MAX_PROMPT_BYTES  # the -1 is BOS: input_ids = BOS + prompt + response
"""383: with the prompt cap and ``BOS``, ``len(input_ids) <= MAX_LEN``."""

# Directory names pruned from the walk: test suites (``test``, ``idlelib/idle_test``, ``lib2to3/tests``, ...) are
# dominated by repetitive assertions, and installed third-party packages are not the standard library.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

_T = TypeVar("_T")


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """List the standard library's ``.py`` files in a deterministic (sorted) order, test directories excluded.

    Args:
        root: the directory to walk; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        The files, sorted by their path relative to ``root``.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(base):
        # Pruning in place stops os.walk from descending into skipped trees at all.
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _truncate_utf8(text: str, max_bytes: int) -> str:
    """Cut ``text`` to at most ``max_bytes`` UTF-8 bytes without leaving half a character behind."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", errors="ignore")


def _functions(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Yield module-level functions and methods, including those under ``if``/``try``/``with`` blocks.

    Functions nested inside other functions are not yielded: their source is already part of the enclosing
    function's response, and walking statements only is much cheaper than ``ast.walk`` over every expression.
    """
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body)
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from _functions(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _functions(handler.body)


def _split_function(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """Return ``(signature + docstring, body)`` for a function with a docstring, or ``None`` if it has none."""
    if ast.get_docstring(node, clean=False) is None or len(node.body) < 2 or node.end_lineno is None:
        return None
    doc_end = node.body[0].end_lineno
    if doc_end is None or node.body[1].lineno <= doc_end:
        return None  # code on the docstring's own line (``"""doc"""; return x``) cannot be split by lines
    # Dedent the whole function at once so a method reads like a top-level function in both halves.
    source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
    source_lines = source.splitlines(keepends=True)
    n_prompt = doc_end - node.lineno + 1
    prompt = "".join(source_lines[:n_prompt])
    response = "".join(source_lines[n_prompt:]).lstrip("\n")
    if not response.strip():
        return None
    return prompt, response


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, restoring its previous state afterwards.

    ``ast.parse`` allocates hundreds of thousands of acyclic node objects, which keeps triggering full collections
    that find nothing; pausing them makes parsing the standard library roughly 40% faster.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _pairs_from_file(path: Path) -> list[tuple[str, str]]:
    """Parse one file into (untruncated) pairs; a file that cannot be read or parsed yields none."""
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            source = f.read()
        with warnings.catch_warnings(), _gc_paused():
            # Old escape sequences in some stdlib files raise SyntaxWarning on newer Pythons; they are not our concern.
            warnings.simplefilter("ignore")
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    return [pair for node in _functions(tree.body) if (pair := _split_function(lines, node)) is not None]


def stdlib_pairs(
    limit: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> list[tuple[str, str]]:
    """Build prompt/response pairs from the standard library's functions that have docstrings.

    Files are read in sorted order and only until ``limit`` pairs are found, so a small corpus is quick to build.
    Each half is truncated to its byte cap; exact duplicate pairs are kept once.

    Args:
        limit: the maximum number of pairs; ``None`` reads the whole standard library (a few seconds).
        root: the directory to read instead of the installed standard library.
        max_prompt_bytes: the prompt's cap in UTF-8 bytes.
        max_response_bytes: the response's cap in UTF-8 bytes.

    Returns:
        ``(prompt, response)`` strings, in file order then source order.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"`limit` must be >= 0 or None, got {limit}.")
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for path in stdlib_files(root):
        if limit is not None and len(pairs) >= limit:
            break
        for prompt, response in _pairs_from_file(path):
            pair = (_truncate_utf8(prompt, max_prompt_bytes), _truncate_utf8(response, max_response_bytes))
            if not pair[1].strip() or pair in seen:
                continue
            seen.add(pair)
            pairs.append(pair)
    return pairs if limit is None else pairs[:limit]


def jsonl_pairs(path: str | os.PathLike[str], limit: int | None = None) -> list[tuple[str, str]]:
    """Read ``{"prompt": ..., "response": ...}`` objects, one per line; blank lines are skipped.

    The pairs are returned as written (no truncation); ``PairDataset`` applies the byte caps when encoding.

    Args:
        path: the JSON Lines file.
        limit: the maximum number of pairs to read; ``None`` reads them all.

    Returns:
        ``(prompt, response)`` strings in file order.

    Raises:
        ValueError: naming the file and line number of the first line that is not valid JSON, not an object, or
            lacks a string ``"prompt"`` or ``"response"``.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"`limit` must be >= 0 or None, got {limit}.")
    pairs: list[tuple[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(pairs) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg}).") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}.")
            for key in ("prompt", "response"):
                if not isinstance(record.get(key), str):
                    raise ValueError(f"{path}, line {lineno}: expected a string {key!r} field.")
            pairs.append((record["prompt"], record["response"]))
    return pairs


def load_pairs(limit: int | None = None, data: str | None = None) -> list[tuple[str, str]]:
    """Load the example's prompt/response pairs.

    Args:
        limit: the maximum number of pairs; ``None`` for all of them.
        data: a JSON Lines file of ``{"prompt": ..., "response": ...}`` objects to use instead of the standard
            library corpus.

    Returns:
        ``(prompt, response)`` strings in a deterministic order.

    Raises:
        ValueError: on a malformed JSON Lines file (the message names the file and line).
    """
    if data is not None:
        return jsonl_pairs(data, limit=limit)
    return stdlib_pairs(limit=limit)


def train_val_split(pairs: Sequence[_T], val_fraction: float = 0.05, seed: int = 0) -> tuple[list[_T], list[_T]]:
    """Split pairs into train and validation sets, the same way for the same seed.

    Both parts keep the input's relative order; shuffling is the data loader's job. Any non-zero fraction of two or
    more pairs puts at least one pair in each part.

    Args:
        pairs: the items to split.
        val_fraction: the share of items that go to validation, in ``[0, 1)``.
        seed: seeds the choice of validation items.

    Returns:
        ``(train, val)``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction}.")
    n = len(pairs)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    val_idx = set(random.Random(seed).sample(range(n), n_val))
    train = [p for i, p in enumerate(pairs) if i not in val_idx]
    val = [p for i, p in enumerate(pairs) if i in val_idx]
    return train, val


def encode_pair(
    prompt: str,
    response: str,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> dict[str, Tensor]:
    """Turn one pair into next-token ``input_ids`` and ``labels`` with the prompt masked out.

    The token sequence is ``BOS + prompt bytes + response bytes + EOS``; ``input_ids`` drops its last token and
    ``labels`` its first, and every label whose target is a prompt byte is ``-100``. The ``EOS`` stays a target even
    when the response was truncated, so the count of targets is always ``len(response bytes) + 1``.

    Args:
        prompt: the conditioning text.
        response: the text to learn.
        max_prompt_bytes: the prompt's byte cap (applied to the bytes, so it may cut inside a character).
        max_response_bytes: the response's byte cap.

    Returns:
        ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}`` with ``T = len(prompt bytes) + len(response bytes)
        + 1``.
    """
    p = list(prompt.encode("utf-8")[:max_prompt_bytes])
    r = list(response.encode("utf-8")[:max_response_bytes])
    tokens = torch.tensor([BOS, *p, *r, EOS], dtype=torch.long)
    input_ids = tokens[:-1].clone()
    labels = tokens[1:].clone()
    labels[: len(p)] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def decode(ids: Sequence[int] | Tensor) -> str:
    """Render token ids as text, dropping special and ignored ids (handy for printing samples).

    Args:
        ids: token ids; anything outside 0-255 is skipped.

    Returns:
        The UTF-8 text, with undecodable bytes replaced.
    """
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(i for i in values if 0 <= i < 256).decode("utf-8", errors="replace")


class PairDataset(Dataset[dict[str, Tensor]]):
    """Map-style dataset that encodes prompt/response pairs on access.

    Args:
        pairs: ``(prompt, response)`` strings, e.g. from ``load_pairs``.
        max_prompt_bytes: the prompt's byte cap.
        max_response_bytes: the response's byte cap.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[str, str]],
        max_prompt_bytes: int = MAX_PROMPT_BYTES,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.pairs = list(pairs)
        self.max_prompt_bytes = max_prompt_bytes
        self.max_response_bytes = max_response_bytes

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        prompt, response = self.pairs[index]
        return encode_pair(prompt, response, self.max_prompt_bytes, self.max_response_bytes)


def collate(batch: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack samples into a batch, right-padding to the batch's longest sample.

    Padding sits at the end, so a causal model needs no attention mask: real positions never attend to it, and its
    labels are ``-100`` so it is never a target.

    Args:
        batch: samples from ``PairDataset``.

    Returns:
        ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}``, padded with ``PAD`` and ``-100``.
    """
    if not batch:
        raise ValueError("Cannot collate an empty batch.")
    length = max(sample["input_ids"].numel() for sample in batch)
    input_ids = torch.full((len(batch), length), PAD, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(batch):
        n = sample["input_ids"].numel()
        input_ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
    return {"input_ids": input_ids, "labels": labels}
