"""Packed sequences: position ids restart at every document, and a token never attends to the document before it.

The loader side is checked against the prepared ``docs.bin`` boundaries (pretraining windows and SFT packs); the
model side on tiny Llama and Falcon models (both Falcon layouts, ``sdpa`` and ``eager``): a document's logits are
bitwise the same whatever document is packed before it. The negative control is the batch the loader gave before
(an all-ones ``attention_mask``, no ``position_ids``): there the logits do depend on the previous document.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zerotrain import models
from zerotrain.data.loader import IGNORE_INDEX, build_loader, document_position_ids
from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.shards import PreparedDataset

SEQ = 64


@pytest.fixture(scope="module")
def pretrain_dataset(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("packing") / "pretrain"
    # Short documents (~200 characters), so most windows hold several.
    prepare(PrepareConfig(output=str(out), input=str(corpus_file), tokenizer=TokenizerArgs(train_vocab_size=500),
                          valid_fraction=0.0, txt_doc_chars=200, progress=False))
    return out


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, llama2_like):
    root = tmp_path_factory.mktemp("packing_sft")
    rows = [{"prompt": f"Question {i}?", "response": "Yes." * (1 + i % 4)} for i in range(40)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareConfig(output=str(root / "out"), input=str(root / "qa.jsonl"), kind="sft",
                          tokenizer=TokenizerArgs(str(llama2_like)), valid_fraction=0.0, progress=False))
    return root / "out"


def expected_positions(starts: list[int], length: int) -> list[int]:
    """The definition, spelt out: the distance back to the latest document start (the window start counts)."""
    return [t - max([0] + [s for s in starts if s <= t]) for t in range(length)]


def test_document_position_ids_restart_at_every_start():
    assert document_position_ids(np.array([0, 3, 4]), 7).tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert document_position_ids(np.array([5]), 7).tolist() == [0, 1, 2, 3, 4, 0, 1]  # a partial first document
    assert document_position_ids(np.array([], np.int64), 4).tolist() == [0, 1, 2, 3]


def test_pretraining_windows_reset_positions_exactly_at_the_prepared_document_boundaries(pretrain_dataset):
    offsets = PreparedDataset(pretrain_dataset).split("train").document_offsets()
    loader = build_loader([(str(pretrain_dataset), 1.0)], "train", SEQ, 1, seed=3)
    source = loader.sources[0]
    resets = 0
    for index in range(min(200, source.num_samples)):  # window index covers tokens [index*SEQ, (index+1)*SEQ)
        starts = [int(o) - index * SEQ for o in offsets if index * SEQ <= o < (index + 1) * SEQ]
        sample = source.sample(index)
        assert "attention_mask" not in sample
        assert sample["position_ids"].tolist() == expected_positions(starts, SEQ)
        resets += len([s for s in starts if s > 0])
    assert resets >= 10, "the fixture should pack documents into shared windows"
    batch = next(loader)
    assert batch["position_ids"].shape == (1, SEQ) and batch["position_ids"].dtype == torch.int64


def test_sft_packs_reset_positions_per_example_and_the_padding_is_a_document_of_its_own(sft_dataset):
    dataset = PreparedDataset(sft_dataset)
    offsets = dataset.split("train").document_offsets()
    loader = build_loader([(str(sft_dataset), 1.0)], "train", SEQ, 1, kind="sft", packing=True)
    source = loader.sources[0]
    for index in range(source.num_samples):
        first, last = source.bounds[index], source.bounds[index + 1]
        start, end = int(offsets[first]), int(offsets[last])
        starts = [int(o) - start for o in offsets[first:last]] + ([end - start] if end - start < SEQ else [])
        sample = source.sample(index)
        assert set(sample) == {"input_ids", "labels", "position_ids"}
        assert sample["position_ids"].tolist() == expected_positions(starts, SEQ)
        assert (sample["labels"][end - start:] == IGNORE_INDEX).all()  # the padded tail is never trained
    assert max(b - a for a, b in zip(source.bounds[:-1], source.bounds[1:])) >= 2  # several examples per pack


def test_padded_rows_keep_their_attention_mask_and_no_position_ids(sft_dataset):
    batch = next(build_loader([(str(sft_dataset), 1.0)], "train", SEQ, 2, kind="sft", packing=False))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}


# ----------------------------------------------------------------------------------------------------------------
# The model: attention confined to each document
# ----------------------------------------------------------------------------------------------------------------

SHAPES = {
    "llama_gqa": dict(family="llama", num_kv_heads=2),
    "falcon_multi_query": dict(family="falcon", num_kv_heads=1),  # Falcon-7B's layout (K/V expanded for sdpa)
    "falcon_new_arch": dict(family="falcon", num_kv_heads=2, new_decoder_architecture=True),  # 40B/180B
}
FIRST, SECOND = 20, 28  # a pack [document A | document B]


def tiny(shape: str, attn: str) -> torch.nn.Module:
    cfg = models.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=256,
                             max_seq_len=128, attn_implementation=attn, **SHAPES[shape])
    torch.manual_seed(0)
    return models.build_model(cfg, "fp32").eval()


def second_document_logits(model, first_doc: torch.Tensor, second_doc: torch.Tensor, packed: bool) -> torch.Tensor:
    ids = torch.cat([first_doc, second_doc])[None]
    if packed:  # what the loader gives now
        inputs = {"position_ids": torch.from_numpy(document_position_ids(np.array([0, FIRST]), ids.shape[1]))[None]}
    else:  # what it gave before: a mask marking only padding (none here)
        inputs = {"attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        return model(input_ids=ids, **inputs).logits[0, FIRST:]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_documents_logits_do_not_depend_on_the_document_packed_before_it(shape, attn):
    model = tiny(shape, attn)
    g = torch.Generator().manual_seed(1)
    doc_a, doc_a2, doc_b = (torch.randint(0, 256, (n,), generator=g) for n in (FIRST, FIRST, SECOND))
    after_a = second_document_logits(model, doc_a, doc_b, packed=True)
    after_a2 = second_document_logits(model, doc_a2, doc_b, packed=True)
    assert torch.equal(after_a, after_a2)
    with torch.no_grad():  # and it is what document B gives on its own, positions counted from its start
        alone = model(input_ids=doc_b[None]).logits[0]
    torch.testing.assert_close(after_a, alone, rtol=0, atol=1e-5)
    # Negative control: the old batch lets B attend to A, so A changes B's logits.
    old_a = second_document_logits(model, doc_a, doc_b, packed=False)
    old_a2 = second_document_logits(model, doc_a2, doc_b, packed=False)
    assert (old_a - old_a2).abs().max() > 1e-2
