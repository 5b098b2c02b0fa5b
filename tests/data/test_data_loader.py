"""The loader: determinism, data-parallel equivalence, resume, epochs, blending, validation, and clear failures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from zerotrain.data.loader import EpochOrder, build_loader, build_valid_loader, has_split
from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.errors import DataError

SEQ = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("loader") / "shakespeare"
    prepare(PrepareConfig(output=str(out), input=str(corpus_file), tokenizer=TokenizerArgs(train_vocab_size=500),
                          valid_fraction=0.1, txt_doc_chars=1000, shard_tokens=5000, progress=False))
    return out


@pytest.fixture(scope="module")
def second_dataset(tmp_path_factory, dataset):
    """A different small corpus prepared with the first one's tokenizer (blending needs a shared tokenizer)."""
    root = tmp_path_factory.mktemp("second")
    (root / "other.txt").write_text("\n\n".join(f"Paragraph {i} of another corpus." * 5 for i in range(300)))
    prepare(PrepareConfig(output=str(root / "out"), input=str(root / "other.txt"),
                          tokenizer=TokenizerArgs(str(dataset)), valid_fraction=0.0, txt_doc_chars=0, progress=False))
    return root / "out"


def take(loader, steps: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def same(a: list[dict], b: list[dict]) -> bool:
    equal = (x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))
    return len(a) == len(b) and all(equal)


def test_pretraining_batches_are_int64_windows_with_labels_equal_to_inputs(dataset):
    loader = build_loader([(str(dataset), 1.0)], "train", SEQ, 3, seed=1)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: see test_data_packing.py
    assert batch["input_ids"].shape == (3, SEQ) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert loader.tokens_per_micro_batch == 3 * SEQ


def test_same_seed_same_batches_other_seed_other_batches(dataset):
    make = lambda seed: build_loader([(str(dataset), 1.0)], "train", SEQ, 4, seed=seed)  # noqa: E731
    assert same(take(make(5), 6), take(make(5), 6))
    assert not same(take(make(5), 6), take(make(6), 6))


def test_four_ranks_see_exactly_what_one_rank_sees(dataset):
    single = build_loader([(str(dataset), 1.0)], "train", SEQ, 8, dp_rank=0, dp_size=1, seed=3)
    ranks = [build_loader([(str(dataset), 1.0)], "train", SEQ, 2, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    steps = single.sources[0].num_samples // 8 + 5  # run past the end of the first epoch
    for _ in range(steps):
        whole = next(single)["input_ids"]
        parts = [next(rank)["input_ids"] for rank in ranks]
        assert torch.equal(torch.cat(parts), whole)


def test_resume_from_state_dict_continues_the_exact_sequence(dataset, second_dataset):
    sources = [(str(dataset), 0.6), (str(second_dataset), 0.4)]
    original = build_loader(sources, "train", SEQ, 4, dp_rank=1, dp_size=2, seed=9)
    take(original, 7)
    state = json.loads(json.dumps(original.state_dict()))  # as stored in a checkpoint
    expected = take(original, 5)
    resumed = build_loader(sources, "train", SEQ, 4, dp_rank=1, dp_size=2, seed=9)
    resumed.load_state_dict(state)
    assert same(take(resumed, 5), expected)


def test_resume_with_another_seed_is_refused(dataset):
    loader = build_loader([(str(dataset), 1.0)], "train", SEQ, 2, seed=1)
    other = build_loader([(str(dataset), 1.0)], "train", SEQ, 2, seed=2)
    with pytest.raises(DataError, match="seed 1 but this run uses 2"):
        other.load_state_dict(loader.state_dict())


def test_each_epoch_is_a_new_permutation_of_every_sample():
    order = EpochOrder(50, seed=0, source_index=0)
    first, second = [order(k) for k in range(50)], [order(k) for k in range(50, 100)]
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second


def test_blending_follows_the_weights(dataset, second_dataset):
    loader = build_loader([(str(dataset), 0.7), (str(second_dataset), 0.3)], "train", SEQ, 10, seed=0)
    for step in range(1, 31):
        next(loader)
        counts = loader.state_dict()["source_samples"]
        assert abs(counts[0] - 0.7 * 10 * step) <= 1 and sum(counts) == 10 * step


def test_blended_samples_come_from_the_named_sources(dataset, second_dataset):
    from zerotrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(dataset)
    loader = build_loader([(str(dataset), 0.5), (str(second_dataset), 0.5)], "train", SEQ, 4, seed=0)
    rows = [tok.decode(row.tolist()) for row in next(loader)["input_ids"]]
    assert sum("another corpus" in row for row in rows) == 2


def test_blending_data_sets_with_different_tokenizers_is_refused(tmp_path, dataset, corpus_file, llama2_like):
    other = tmp_path / "other"
    prepare(PrepareConfig(output=str(other), input=str(corpus_file), tokenizer=TokenizerArgs(str(llama2_like)),
                          max_documents=5, progress=False))
    with pytest.raises(DataError, match="different tokenizers"):
        build_loader([(str(dataset), 1.0), (str(other), 1.0)], "train", SEQ, 2)


def test_validation_batches_are_fixed_and_sharded_like_training(dataset):
    assert has_split(dataset, "valid")
    valid = build_valid_loader(dataset, SEQ, 4, num_batches=3)
    first, again = list(valid), list(valid)
    assert len(first) == 3 and same(first, again)
    halves = [list(build_valid_loader(dataset, SEQ, 2, dp_rank=r, dp_size=2, num_batches=3)) for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([halves[0][step]["input_ids"], halves[1][step]["input_ids"]]),
                           first[step]["input_ids"])


def test_missing_data_set_says_how_to_create_it(tmp_path):
    with pytest.raises(DataError, match=rf"{tmp_path / 'nowhere'}: prepared data set not found.*data/prepare.py"):
        build_loader([(str(tmp_path / "nowhere"), 1.0)], "train", SEQ, 2)


def test_corrupted_shard_is_named(tmp_path, dataset):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    shard = copy / "train" / "000001.tokens.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{shard}: sha256 does not match .*manifest.json"):
        build_loader([(str(copy), 1.0)], "train", SEQ, 2)


def test_truncated_or_missing_shard_is_named_even_without_checksums(tmp_path, dataset):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    shard = copy / "train" / "000000.tokens.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{shard}: \d+ bytes, but .*manifest.json says \d+"):
        build_loader([(str(copy), 1.0)], "train", SEQ, 2, verify="sizes")
    shard.unlink()
    with pytest.raises(DataError, match=rf"{shard}: .*missing"):
        build_loader([(str(copy), 1.0)], "train", SEQ, 2, verify="sizes")


def test_interrupted_data_set_without_manifest_is_refused(tmp_path, dataset):
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(DataError, match=rf"{copy / 'manifest.json'}: missing"):
        build_loader([(str(copy), 1.0)], "train", SEQ, 2)


def test_tokenizer_larger_than_the_model_vocab_is_refused(dataset):
    with pytest.raises(DataError, match=r"has 500 tokens but model.vocab_size=256.*model.vocab_size>=500"):
        build_loader([(str(dataset), 1.0)], "train", SEQ, 2, vocab_size=256)
    build_loader([(str(dataset), 1.0)], "train", SEQ, 2, vocab_size=512)  # a larger embedding is fine


def test_pretraining_without_packing_pads_one_document_per_row(dataset):
    loader = build_loader([(str(dataset), 1.0)], "train", 512, 2, packing=False)
    batch = next(loader)
    labels, attention = batch["labels"].numpy(), batch["attention_mask"].numpy()
    assert ((labels == -100) == (attention == 0)).all()
    assert np.all(attention.sum(1) > 0)
