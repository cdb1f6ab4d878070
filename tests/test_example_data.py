"""Tests for the example's data pipeline (``examples/stdlib_corpus.py``) and model (``examples/tiny_lm.py``)."""

from __future__ import annotations

import json
import statistics
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

# The examples are scripts, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import stdlib_corpus as sc
import tiny_lm

SHORT_PAIRS = [
    ("def f():\n", "    return 1\n"),
    ("def g(x):\n    '''Double.'''\n", "    y = 2 * x\n    return y\n"),
    ("p", "é"),  # a multi-byte character: counts are in bytes, not characters
    ("", "abc"),
]


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, str]]:
    return sc.load_pairs(limit=600)


def test_encode_masks_prompt_and_keeps_every_response_byte() -> None:
    for prompt, response in SHORT_PAIRS:
        sample = sc.encode_pair(prompt, response)
        ids, labels = sample["input_ids"], sample["labels"]
        p, r = prompt.encode(), response.encode()
        assert ids.dtype == labels.dtype == torch.long
        assert ids.tolist() == [sc.BOS, *p, *r]
        assert labels.shape == ids.shape
        assert (labels[: len(p)] == sc.IGNORE_INDEX).all()
        assert labels[len(p) :].tolist() == [*r, sc.EOS]
        assert int((labels != sc.IGNORE_INDEX).sum()) == len(r) + 1


def test_collate_pads_at_the_end_and_counts_match_labels() -> None:
    ds = sc.PairDataset(SHORT_PAIRS)
    batch = sc.collate([ds[i] for i in range(len(ds))])
    assert set(batch) == {"input_ids", "labels"}
    lengths = [len(p.encode()) + len(r.encode()) + 1 for p, r in SHORT_PAIRS]
    assert batch["input_ids"].shape == batch["labels"].shape == (len(SHORT_PAIRS), max(lengths))
    for row, n in enumerate(lengths):
        assert (batch["input_ids"][row, n:] == sc.PAD).all()
        assert (batch["labels"][row, n:] == sc.IGNORE_INDEX).all()
        assert torch.equal(batch["labels"][row, :n], ds[row]["labels"])
    expected = sum(len(r.encode()) + 1 for _, r in SHORT_PAIRS)
    assert int((batch["labels"] != sc.IGNORE_INDEX).sum()) == expected


def test_collate_rejects_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty"):
        sc.collate([])


def test_truncation_keeps_samples_within_max_len() -> None:
    sample = sc.encode_pair("p" * 1000, "r" * 1000)
    assert sample["input_ids"].numel() == sc.MAX_LEN == tiny_lm.LMConfig().max_len
    assert int((sample["labels"] != sc.IGNORE_INDEX).sum()) == sc.MAX_RESPONSE_BYTES + 1
    # byte-level truncation of the corpus text never splits a character
    assert sc._truncate_utf8("aé", 2) == "a"


def test_corpus_is_deterministic_well_formed_and_ragged(corpus: list[tuple[str, str]]) -> None:
    assert len(corpus) == 600
    assert sc.load_pairs(limit=50) == corpus[:50]
    for prompt, response in corpus:
        assert prompt.lstrip().startswith(("def ", "async def "))
        assert response.strip()
        assert len(prompt.encode()) <= sc.MAX_PROMPT_BYTES
        assert len(response.encode()) <= sc.MAX_RESPONSE_BYTES
    counts = [int((sc.encode_pair(p, r)["labels"] != sc.IGNORE_INDEX).sum()) for p, r in corpus]
    assert counts == [len(r.encode()) + 1 for _, r in corpus]
    assert statistics.pstdev(counts) / statistics.mean(counts) > 0.5


def test_corpus_skips_test_directories() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).parts for p in sc.stdlib_files()]
    assert rel and all(not {"test", "tests", "idle_test", "site-packages"} & set(parts) for parts in rel)


def test_corpus_reads_only_what_it_needs(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        'def a():\n    """Doc."""\n    return 1\n\n\ndef b():\n    """Only a docstring."""\n'
    )
    (tmp_path / "b.py").write_text("def broken(:\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "c.py").write_text('def c():\n    """Doc."""\n    return 3\n')
    assert sc.stdlib_pairs(root=tmp_path) == [('def a():\n    """Doc."""\n', "    return 1\n")]
    assert sc.stdlib_pairs(limit=0, root=tmp_path) == []


def test_train_val_split_is_deterministic_and_disjoint() -> None:
    items = list(range(100))
    train, val = sc.train_val_split(items, val_fraction=0.1, seed=3)
    assert (train, val) == sc.train_val_split(items, val_fraction=0.1, seed=3)
    assert len(val) == 10 and sorted(train + val) == items
    assert sc.train_val_split(items, val_fraction=0.1, seed=4)[1] != val
    assert len(sc.train_val_split(items[:3], val_fraction=0.05)[1]) == 1
    with pytest.raises(ValueError):
        sc.train_val_split(items, val_fraction=1.0)


def test_jsonl_loading(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": p, "response": r} for p, r in SHORT_PAIRS]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    assert sc.load_pairs(data=str(path)) == SHORT_PAIRS
    assert sc.load_pairs(limit=2, data=str(path)) == SHORT_PAIRS[:2]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "a", "response": ', "not valid JSON"),
        ('["a", "b"]', "JSON object"),
        ('{"prompt": "a"}', "'response'"),
        ('{"prompt": 1, "response": "b"}', "'prompt'"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=match) as info:
        sc.load_pairs(data=str(path))
    assert str(path) in str(info.value) and "line 3" in str(info.value)


def test_model_shape_and_causality() -> None:
    config = tiny_lm.LMConfig(d_model=32, n_heads=4, n_layers=2, max_len=64)
    model = tiny_lm.TinyLM(config, seed=0).double().eval()
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 20, config.vocab_size) and logits.dtype == torch.float64
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % config.vocab_size
    new_logits = model(changed)
    assert torch.equal(new_logits[:, :12], logits[:, :12])
    assert not torch.allclose(new_logits[:, 12:], logits[:, 12:])
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_model_seed_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = tiny_lm.TinyLM(seed=7), tiny_lm.TinyLM(seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert 100_000 < sum(p.numel() for p in a.parameters()) < 1_000_000


def test_masked_loss_ignores_padding_and_trains_end_to_end(corpus: list[tuple[str, str]]) -> None:
    ds = sc.PairDataset(corpus[:4])
    batch = sc.collate([ds[i] for i in range(len(ds))])
    model = tiny_lm.TinyLM(tiny_lm.LMConfig(d_model=32, n_layers=1), seed=0).double()
    logits = model(batch["input_ids"])
    loss = tiny_lm.masked_lm_loss(logits, batch["labels"])
    valid = batch["labels"] != sc.IGNORE_INDEX
    manual = torch.nn.functional.cross_entropy(logits[valid], batch["labels"][valid], reduction="sum") / valid.sum()
    torch.testing.assert_close(loss, manual)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    empty = torch.full_like(batch["labels"], sc.IGNORE_INDEX)
    assert torch.isnan(tiny_lm.masked_lm_loss(logits.detach(), empty))
