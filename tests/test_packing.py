"""Pre-tokenized documents, packing with EOS and per-document positions, epochs and their
resumable position, and the block-diagonal attention that keeps documents apart."""
import json

import numpy as np
import pytest
import torch

from helpers import relative_error
from orchestration.packing import (IGNORE_INDEX, DataPosition, EpochReader, PackedRows, TokenDocuments,
                                   attention_mask, from_lists, load_token_documents, save_token_documents)

EOS, PAD = 1, 0
DOCUMENTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19, EOS], [20], [21, 22, 23, 24]]


def _naive_rows(documents, row_tokens):
    """The epoch's rows built token by token, independently of `PackedRows.row`: documents in
    the given order, an EOS after each that lacks one, rows cut every ``row_tokens``."""
    stream = []  # (token, document, position in document, label)
    for number, document in enumerate(documents):
        tokens = list(document) + ([] if document[-1] == EOS else [EOS])
        for t, token in enumerate(tokens):
            stream.append((token, number, t, tokens[t + 1] if t + 1 < len(tokens) else IGNORE_INDEX))
    rows = []
    for start in range(0, len(stream), row_tokens):
        chunk = stream[start:start + row_tokens]
        first_position, pieces, columns = {}, [], ([], [], [], [])
        for token, document, position, label in chunk:
            if document not in first_position:
                first_position[document] = position
                pieces.append(document)
            columns[0].append(token)
            columns[1].append(label)
            columns[2].append(position - first_position[document])
            columns[3].append(pieces.index(document))
        padding = row_tokens - len(chunk)
        columns[0].extend([PAD] * padding)
        columns[1].extend([IGNORE_INDEX] * padding)
        columns[2].extend(range(padding))
        columns[3].extend([len(pieces)] * padding)
        rows.append([np.array(column) for column in columns])
    return rows


def test_jsonl_and_npy_give_the_same_documents(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"input_ids": document}) for document in DOCUMENTS) + "\n\n")
    from_jsonl = load_token_documents(str(jsonl))
    path = save_token_documents(str(tmp_path / "docs.npy"), from_lists(DOCUMENTS))
    from_npy = load_token_documents(path)
    assert isinstance(from_npy.tokens, np.memmap)
    for documents in (from_jsonl, from_npy):
        assert documents.count == len(DOCUMENTS)
        assert [documents.document(d).tolist() for d in range(documents.count)] == DOCUMENTS
    from_npy.check_vocab(25)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 20\), found \[1, 24\]"):
        from_npy.check_vocab(20)


def test_malformed_token_files_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"text": "no ids"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        load_token_documents(str(bad))
    np.save(tmp_path / "alone.npy", np.arange(4))
    with pytest.raises(FileNotFoundError, match="alone.offsets.npy"):
        load_token_documents(str(tmp_path / "alone.npy"))
    with pytest.raises(ValueError, match="offsets\\[-1\\] = len\\(tokens\\) = 4"):
        TokenDocuments(np.arange(4), np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="document 1 is empty"):
        TokenDocuments(np.arange(4), np.array([0, 2, 2, 4]))
    with pytest.raises(ValueError, match="NAME.jsonl or NAME.npy"):
        load_token_documents(str(tmp_path / "docs.txt"))


@pytest.mark.parametrize("row_tokens", [4, 7, 32])
def test_rows_hold_eos_shifted_labels_and_positions_restarting_per_document(row_tokens):
    packed = PackedRows(from_lists(DOCUMENTS), row_tokens, eos_id=EOS, pad_id=PAD, shuffle=False)
    expected = _naive_rows(DOCUMENTS, row_tokens)
    assert packed.rows_in_epoch() == len(expected)
    for index, row in enumerate(expected):
        for got, want in zip(packed.row(0, index), row):
            np.testing.assert_array_equal(got, want)


def test_each_epoch_reads_every_document_once_in_an_order_of_its_own():
    documents = from_lists([[10 + d] * (d % 3 + 1) for d in range(20)])
    packed = PackedRows(documents, 8, eos_id=EOS, pad_id=PAD, seed=3)
    orders = [packed.order(epoch) for epoch in range(3)]
    assert all(sorted(order.tolist()) == list(range(20)) for order in orders)
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(PackedRows(documents, 8, eos_id=EOS, pad_id=PAD, seed=3).order(1), orders[1])
    for epoch in (0, 1):
        ordered = [documents.document(d).tolist() for d in orders[epoch]]
        for got, want in zip((packed.row(epoch, i) for i in range(packed.rows_in_epoch())),
                             _naive_rows(ordered, 8)):
            for column, expected in zip(got, want):
                np.testing.assert_array_equal(column, expected)


def test_a_resumed_reader_yields_exactly_the_remaining_rows():
    packed = PackedRows(from_lists(DOCUMENTS), 5, eos_id=EOS, pad_id=PAD, seed=1)
    per_epoch = packed.rows_in_epoch()  # 6 rows: the batches of 4 cross into epoch 1 and 2
    reader = EpochReader(packed)
    uninterrupted = [reader.next_batch(4) for _ in range(5)]
    assert reader.position == DataPosition(20 // per_epoch, 20 % per_epoch)
    reader = EpochReader(packed)
    for _ in range(2):
        reader.next_batch(4)
    saved = json.loads(json.dumps(reader.state_dict()))
    resumed = EpochReader(PackedRows(from_lists(DOCUMENTS), 5, eos_id=EOS, pad_id=PAD, seed=1))
    resumed.load_state_dict(saved)
    for want in uninterrupted[2:]:
        got = resumed.next_batch(4)
        for name in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name))
    assert uninterrupted[1].input_ids[2:].tolist() != uninterrupted[0].input_ids[2:].tolist()


def test_attention_mask_is_block_diagonal_and_causal():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    allowed = attention_mask(documents, "sdpa")
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        for j in range(i + 1):
            expected[i, j] = bool(documents[0, i] == documents[0, j])
    assert allowed.shape == (1, 1, 6, 6) and torch.equal(allowed[0, 0], expected)
    additive = attention_mask(documents, "eager", torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive[0, 0] == 0, expected)
    assert (additive[0, 0][~expected] == torch.finfo(torch.bfloat16).min).all()
    assert attention_mask(documents, "flash_attention_2") is None
    with pytest.raises(ValueError, match="implementation: expected sdpa, eager, flex_attention"):
        attention_mask(documents, "flash")


def test_the_flex_block_mask_is_the_same_mask_and_skips_tiles_across_documents():
    from torch.nn.attention.flex_attention import create_mask

    from orchestration.packing import FLEX_BLOCK_SIZE

    tile = FLEX_BLOCK_SIZE
    documents = torch.tensor([[0] * tile + [1] * tile + [2] * tile,  # boundaries on tile edges
                              [0] * 100 + [1] * 100 + [2] * (3 * tile - 200)])  # boundaries inside tiles
    block = attention_mask(documents, "flex_attention")
    assert block.shape == (2, 1, 3 * tile, 3 * tile) and block.BLOCK_SIZE == (tile, tile)
    dense = create_mask(block.mask_mod, 2, 1, 3 * tile, 3 * tile, device="cpu")
    assert torch.equal(dense, attention_mask(documents, "sdpa"))
    tiles = block.to_dense()[:, 0].bool()  # [B, query tiles, key tiles]: the tiles the kernel visits
    assert torch.equal(tiles[0], torch.eye(3, dtype=torch.bool))  # one document a tile: only the diagonal
    assert torch.equal(tiles[1], torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool))
    short = torch.tensor([[0, 0, 1, 1, 1, 2]])  # a row shorter than a tile: one partial tile
    assert torch.equal(create_mask(attention_mask(short, "flex_attention").mask_mod, 1, 1, 6, 6, device="cpu"),
                       attention_mask(short, "sdpa"))


def test_the_flex_tiles_are_those_create_block_mask_finds():
    """Random packed rows (lengths on and off tile edges, documents across tiles): the skipped,
    full and partial tiles, for the forward (by query tile) and the backward (by key tile), are
    torch's own ``create_block_mask``'s for the same mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from orchestration.packing import FLEX_BLOCK_SIZE

    generator = torch.Generator().manual_seed(5)
    for rows, length in ((2, 384), (3, 300), (1, 129), (2, 1000)):
        documents = torch.cumsum(torch.rand(rows, length, generator=generator) < 0.01, dim=1)
        block = attention_mask(documents, "flex_attention")
        expected = create_block_mask(lambda b, h, q, k: (documents[b, q] == documents[b, k]) & (k <= q), rows, None,
                                     length, length, device="cpu", BLOCK_SIZE=FLEX_BLOCK_SIZE, _compile=False)
        assert block.seq_lengths == expected.seq_lengths == (length, length)
        for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                                ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            ours, theirs = (getattr(mask, counts) for mask in (block, expected))
            assert torch.equal(ours, theirs), counts
            for b in range(rows):
                for tile in range(ours.shape[2]):
                    kept = int(ours[b, 0, tile])
                    assert sorted(getattr(block, indices)[b, 0, tile, :kept].tolist()) == \
                        sorted(getattr(expected, indices)[b, 0, tile, :kept].tolist()), (indices, b, tile)


@pytest.fixture
def eager_flex_attention(monkeypatch):
    """Hugging Face's flex_attention path with torch's eager flex_attention instead of the
    compiled one (whose compile would dominate the CPU suite); the eager one computes
    the same masked softmax, forward only on the CPU."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    def eager(query, key, value, training=False, **options):
        return flex_attention(query, key, value, **options)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_flex_attention_on_packed_rows_equals_the_dense_mask(family, eager_flex_attention):
    from helpers_hf import tiny_causal_lm
    from orchestration.hf_models import final_hidden_states

    dense, flex = tiny_causal_lm(family, attention="sdpa").eval(), tiny_causal_lm(family, attention="flex_attention")
    flex.load_state_dict(dense.state_dict())
    flex.eval()

    def hidden_of(documents):
        rows = PackedRows(from_lists(documents), 12, eos_id=EOS, pad_id=PAD, shuffle=False)
        batch = rows.batch([(0, index) for index in range(rows.rows_in_epoch())])
        with torch.no_grad():
            return [final_hidden_states(model, batch.input_ids, position_ids=batch.position_ids,
                                        attention_mask=attention_mask(batch.document_ids, attention))
                    for model, attention in ((dense, "sdpa"), (flex, "flex_attention"))], batch

    (want, got), batch = hidden_of(DOCUMENTS)  # 3 rows: several documents a row, one split, padding
    assert (batch.document_ids.amax(1) >= 1).all() and (batch.input_ids[-1, -2:] == PAD).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = [list(document) for document in DOCUMENTS]
    changed[1] = [40, 41]  # the second document's tokens differ, same length
    (_, moved), _ = hidden_of(changed)
    other = batch.document_ids != batch.document_ids[0, 4]  # row 0: [5, 6, 7, EOS | 8, 9, EOS | ...]
    other[1:] = True
    assert batch.input_ids[0, 4:6].tolist() == [8, 9]
    torch.testing.assert_close(moved[other], got[other], rtol=0, atol=1e-6)
    assert not torch.allclose(moved[0, 4:6], got[0, 4:6])


@pytest.mark.slow  # torch compiles flex_attention for the CPU once: 10-30 s on two cores
def test_compiled_flex_attention_compiles_once_for_every_block_mask():
    """The path models take on CUDA (Hugging Face's compiled flex_attention) with the masks of
    two different batches of one shape, in training and eval mode: one compiled graph, equal to
    sdpa with the dense mask. Forward only: torch has no flex_attention backward on the CPU."""
    import torch.nn.functional as F
    from transformers.integrations.flex_attention import flex_attention_forward

    torch._dynamo.reset()
    module = torch.nn.Module()
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 160, 16, generator=generator) for _ in range(3))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for cuts, training in (([30, 150], False), ([90], True), ([10, 20, 129], False)):
            documents = torch.zeros(2, 160, dtype=torch.long)
            for cut in cuts:
                documents[:, cut:] += 1
            documents[1] = documents[1].flip(0).neg() + documents[1].max()
            module.train(training)
            got, _ = flex_attention_forward(module, query, key, value, attention_mask(documents, "flex_attention"))
            want = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask(documents, "sdpa"))
            torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_a_token_never_attends_across_a_document(family, attention):
    from helpers_hf import tiny_causal_lm
    from orchestration.hf_models import final_hidden_states

    model = tiny_causal_lm(family, attention=attention).eval()
    a, b = [5, 6, 7, 8, 9], [30, 31, 32, 33, 34, 35]

    def hidden_of(documents):
        rows = PackedRows(from_lists(documents), 16, eos_id=EOS, pad_id=PAD, shuffle=False)
        batch = rows.batch([(0, 0)])
        mask = attention_mask(batch.document_ids, attention, torch.float32)
        with torch.no_grad():
            return final_hidden_states(model, batch.input_ids, position_ids=batch.position_ids,
                                       attention_mask=mask)[0], batch

    hidden, batch = hidden_of([a, b])
    changed, _ = hidden_of([[40, 41, 42, 43, 44], b])  # document A's tokens differ, same length
    b_span = slice(len(a) + 1, len(a) + 1 + len(b) + 1)
    assert batch.document_ids[0, b_span].unique().tolist() == [1]
    torch.testing.assert_close(changed[b_span], hidden[b_span], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:len(a)], hidden[:len(a)])
    # B packed after A is B alone at positions 0..
    with torch.no_grad():
        alone = final_hidden_states(model, torch.tensor([b + [EOS]]))[0]
    torch.testing.assert_close(hidden[b_span], alone, rtol=1e-5, atol=1e-5)
    # the installed transformers also cuts sequences where packed position_ids restart (no mask):
    # the path flash-attention's varlen kernels take
    with torch.no_grad():
        by_positions = final_hidden_states(model, batch.input_ids, position_ids=batch.position_ids)[0]
    torch.testing.assert_close(by_positions, hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_flex_attention_equals_the_dense_mask_on_the_gpu_at_a_real_shape():
    """A Qwen2.5-0.5B-like model (4 of its 24 layers), 4 packed rows of 2048 tokens, bf16 autocast
    over float32 weights as the student trains: hidden states and every parameter's gradient
    with flex_attention are as close to the float32 dense-mask reference as sdpa's in bf16 are;
    a second batch of other documents (eval forward, then training forward and backward) runs
    the compiled kernels without recompiling; a batch of fewer rows (one recompile, the batch
    size then dynamic) too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orchestration.hf_models import final_hidden_states

    config = dict(vocab_size=32_000, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    models = {"sdpa": Qwen2ForCausalLM(Qwen2Config(**config, attn_implementation="sdpa")).cuda()}
    models["flex_attention"] = Qwen2ForCausalLM(Qwen2Config(**config, attn_implementation="flex_attention")).cuda()
    models["flex_attention"].load_state_dict(models["sdpa"].state_dict())
    generator = np.random.default_rng(0)

    def batch_of(seed, rows=4):
        lengths = np.random.default_rng(seed).integers(30, 3000, size=12)  # some longer than a row: split
        documents = [generator.integers(3, 32_000, size=n).tolist() for n in lengths]
        return PackedRows(from_lists(documents), 2048, eos_id=EOS, pad_id=PAD, shuffle=False).batch(
            [(0, index) for index in range(rows)])

    def run(attention, batch, autocast=True, train=True):
        model = models[attention].train(train)
        model.zero_grad(set_to_none=True)
        mask = attention_mask(batch.document_ids.cuda(), attention, torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(train):
            hidden = final_hidden_states(model, batch.input_ids.cuda(), position_ids=batch.position_ids.cuda(),
                                         attention_mask=mask).float()
        if not train:
            return hidden, None
        probe = torch.randn(hidden.shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
        (hidden * probe).sum().backward()
        return hidden.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def assert_as_close_as_sdpa(flex, batch):
        reference, dense = run("sdpa", batch, autocast=False), run("sdpa", batch)
        for name, got, want, base in zip(("hidden states", "gradients"), flex, reference, dense):
            if got is None:
                continue
            error, bf16_error = ((value - want).norm().item() / want.norm().item() for value in (got, base))
            assert error <= 2 * bf16_error + 1e-3, f"{name}: flex {error:.2e}, sdpa in bf16 {bf16_error:.2e}"

    batch = batch_of(1)
    assert (batch.document_ids.amax(1) >= 1).all()
    assert_as_close_as_sdpa(run("flex_attention", batch), batch)
    run("flex_attention", batch, train=False)  # the eval forward compiled too
    other = batch_of(2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        evaluated, trained = run("flex_attention", other, train=False), run("flex_attention", other)
    assert_as_close_as_sdpa(evaluated, other)
    assert_as_close_as_sdpa(trained, other)
    fewer = batch_of(3, rows=3)  # held-out chunks may have other row counts: one recompile, batch size dynamic
    assert_as_close_as_sdpa(run("flex_attention", fewer, train=False), fewer)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_attention_2", "flex_attention"])
def test_documents_stay_apart_on_the_gpu_in_bf16(attention):
    """Real row lengths and bf16: the mask (or, for flash-attention's varlen kernels, the
    restarting position ids) keeps document B's hidden states those of B alone."""
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    from transformers import LlamaConfig, LlamaForCausalLM

    from orchestration.hf_models import final_hidden_states

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32_064, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         attn_implementation=attention)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    generator = np.random.default_rng(0)
    a, b, c = (generator.integers(3, 32_000, size=n).tolist() for n in (700, 900, 300))
    rows = PackedRows(from_lists([a, b, c]), 2048, eos_id=EOS, pad_id=PAD, shuffle=False)

    def hidden_of(documents, one_document=False):
        """The packed row's final states; ``one_document``: masked as one document (a leak)."""
        batch = PackedRows(from_lists(documents), 2048, eos_id=EOS, pad_id=PAD, shuffle=False).batch([(0, 0)])
        document_ids = torch.zeros_like(batch.document_ids) if one_document else batch.document_ids
        mask = attention_mask(document_ids.cuda(), attention, torch.bfloat16)
        with torch.no_grad():
            return final_hidden_states(model, batch.input_ids.cuda(), position_ids=batch.position_ids.cuda(),
                                       attention_mask=mask)[0].float()

    hidden = hidden_of([a, b, c])
    changed = hidden_of([generator.integers(3, 32_000, size=700).tolist(), b, c])
    b_span = slice(len(a) + 1, len(a) + len(b) + 2)
    with torch.no_grad():
        alone = final_hidden_states(model, torch.tensor([b + [EOS]], device="cuda"))[0].float()
    # bf16 kernels of other shapes round B's states apart by a few ulps (a handful of elements by
    # 0.03); a leak moves them by O(1). Judged on the whole span, against a real leak's size.
    noise = 2e-2
    assert relative_error(changed[b_span], hidden[b_span]) < noise
    assert relative_error(hidden[b_span], alone) < noise
    if attention != "flash_attention_2":  # its leak-free packing does not come from the mask
        assert relative_error(hidden_of([a, b, c], one_document=True)[b_span], alone) > 10 * noise
    assert rows.rows_in_epoch() == 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_held_out_ce_of_packed_rows_is_each_documents_ce_alone(attention):
    import torch.nn.functional as F

    from helpers_hf import VOCAB, tiny_causal_lm
    from orchestration.models import held_out_sums

    model = tiny_causal_lm("llama", attention=attention).eval()
    batch = PackedRows(from_lists(DOCUMENTS), 8, eos_id=EOS, pad_id=PAD, shuffle=False).batch(
        [(0, index) for index in range(4)])  # 4 rows of 8, two documents split across rows
    chunk = (batch.input_ids, batch.labels, batch.position_ids, batch.document_ids)
    total, count = held_out_sums(model, chunk, VOCAB, torch.device("cpu"), attention)
    expected, tokens = 0.0, 0  # every piece of a document run alone, at positions 0..
    for row in range(batch.input_ids.shape[0]):
        for piece in batch.document_ids[row].unique():
            where = batch.document_ids[row] == piece
            labels = batch.labels[row, where]
            with torch.no_grad():
                logits = model(input_ids=batch.input_ids[row, where][None]).logits[0, :, :VOCAB]
            expected += F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    assert count == tokens == sum(len(document) for document in DOCUMENTS) - 1  # [19, EOS]'s EOS is its own
    assert total == pytest.approx(expected, rel=1e-5)
    causal, _ = held_out_sums(model, chunk[:2] + (None, None), VOCAB, torch.device("cpu"), attention)
    assert causal != pytest.approx(expected, rel=1e-3)  # attending across documents changes the CE
