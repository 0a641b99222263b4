"""The teacher cache in the driver (CPU, tiny sizes): mode=cache killed and run again writes the
shards an uninterrupted write does; a cache made for another run is refused with one line
and exit status 2; training from the cache equals training with the live teacher."""
import json
import math
import os

import pytest
import torch

from orchestration.config import Config
from orchestration.teacher_cache import TeacherCacheReader

ray = pytest.importorskip("ray")



def _tiny(tmp_path, name, **overrides):
    values = dict(output_dir=str(tmp_path / name), device="cpu", max_corpus_bytes=8_000, tokenizer_vocab=300,
                  row_tokens=32, rows_per_micro_batch=4, micro_batches=2, teacher_hidden=32, teacher_layers=1,
                  teacher_pretrain_steps=3, student_hidden=16, student_layers=1, heads=2, steps=4, k=8,
                  warmup_steps=2, checkpoint_every=0, cache_rows_per_shard=6)
    values.update(overrides)
    return Config(**values)


def _shards(directory):
    with open(os.path.join(directory, "manifest.json")) as handle:
        manifest = json.load(handle)
    return manifest["complete"], [(shard["name"], shard["sha256"]) for shard in manifest["shards"]]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """An uninterrupted top-k cache write: (its tmp_path, the cache directory)."""
    from orchestration.driver import run

    tmp_path = tmp_path_factory.mktemp("cache")
    cache = str(tmp_path / "whole_cache")
    summary = run(_tiny(tmp_path, "whole", mode="cache", teacher_cache=cache), progress=False)
    assert summary["complete"] and summary["kind"] == "topk" and summary["entries"] == 8
    return tmp_path, cache


def test_a_killed_cache_write_resumes_to_the_uninterrupted_shards(written):
    from orchestration.driver import run

    tmp_path, whole = written
    cache = str(tmp_path / "resumed_cache")
    # batches of a step's 8 rows, shards of 6: stopped after 3 batches (rows 0-23, 4 shards), then after 2
    # more (rows 24-39: shards of 24-29 and 30-35, rows 36-39 buffered and lost)
    for stop_after in (2, 1):
        first = run(_tiny(tmp_path, "resumed", mode="cache", teacher_cache=cache, stop_after=stop_after,
                          overwrite=True), progress=False)
        assert not first["complete"]
    complete, shards = _shards(cache)
    assert not complete and len(shards) == 6
    assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]
    run(_tiny(tmp_path, "resumed", mode="cache", teacher_cache=cache, overwrite=True), progress=False)
    assert _shards(cache) == _shards(whole)
    with TeacherCacheReader(cache) as resumed, TeacherCacheReader(whole) as reference:
        rows = torch.arange(resumed.num_rows)
        got, expected = resumed.read(rows), reference.read(rows)
        assert torch.equal(got.indices, expected.indices) and torch.equal(got.logprobs, expected.logprobs)


@pytest.mark.parametrize("overrides, field", [(dict(temperature=2.0), "temperature"),
                                              (dict(row_tokens=16), "data_hash"),
                                              (dict(tokenizer_vocab=280), "tokenizer_hash"),
                                              (dict(k=4), "k"),
                                              (dict(support="sampled"), "support")])
def test_a_cache_made_for_another_run_is_refused_in_one_line(written, overrides, field, capsys):
    import orchestrate

    tmp_path, cache = written
    values = dict(vars(_tiny(tmp_path, "refused", teacher_cache=cache)), **overrides)
    arguments = [item for name, value in values.items() if value is not None
                 for item in ("--set", f"{name}={json.dumps(value) if not isinstance(value, str) else value}")]
    assert orchestrate.main(arguments) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("orchestrate.py:")]
    assert len(lines) == 1 and field in lines[0]
    option = "support" if field == "support" else "teacher_cache"
    assert lines[0].startswith(f"orchestrate.py: error: {option}:")


@pytest.mark.slow  # Ray and three driver runs, the acceptance test of training from a cache
def test_training_from_the_cache_equals_training_with_the_live_teacher(written, ray_cluster):
    # three driver runs on one Ray cluster: live, from the top-k cache, from a cache of samples
    # with support="sampled"
    from orchestration.driver import run
    from orchestration.metrics_log import read_rows

    tmp_path, cache = written
    samples_cache = str(tmp_path / "samples_cache")
    written_samples = run(_tiny(tmp_path, "write_samples", mode="cache", teacher_cache=samples_cache,
                                cache_samples=4, cache_encoding="compact"), progress=False)
    assert written_samples["complete"] and written_samples["kind"] == "samples"
    live = run(_tiny(tmp_path, "live", placement="fused"), progress=False, return_parameters=True)
    cached = run(_tiny(tmp_path, "cached", teacher_cache=cache), progress=False, return_parameters=True)
    sampled = run(_tiny(tmp_path, "sampled", teacher_cache=samples_cache, cache_samples=4, support="sampled"),
                  progress=False)
    sampled_rows = read_rows(sampled["metrics"])
    # a sampled estimate of a row may fall below 0; a step's mean over its tokens stays finite and non-zero
    assert len(sampled_rows) == 4 and all(math.isfinite(row["loss"]) and row["kd"] != 0 for row in sampled_rows)
    live_rows, cached_rows = read_rows(live["metrics"]), read_rows(cached["metrics"])
    assert [row["step"] for row in cached_rows] == list(range(4))
    for got, expected in zip(cached_rows, live_rows):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=0)
        assert got["kd"] == pytest.approx(expected["kd"], rel=1e-6, abs=0)
    assert torch.allclose(cached["student_parameters"][0], live["student_parameters"][0], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # Ray and two driver runs: the acceptance test above on packed pre-tokenized documents
def test_a_cache_of_pre_tokenized_documents_trains_as_the_live_teacher(ray_cluster, tmp_path):
    """Pre-tokenized ``.npy`` documents (no tokenizer; packed with position ids restarting per
    document and the block-diagonal mask): the cache is scored under that layout and read in
    the epoch order, so training from it equals training with the live teacher."""
    import numpy as np

    from orchestration.driver import run
    from orchestration.metrics_log import read_rows
    from orchestration.packing import from_lists, save_token_documents

    generator = np.random.default_rng(0)
    documents = [generator.integers(3, 300, int(generator.integers(5, 50))) for _ in range(60)]
    data = save_token_documents(str(tmp_path / "documents.npy"), from_lists(documents))
    cache = str(tmp_path / "cache")
    common = dict(data_path=data, attention="eager")
    written = run(_tiny(tmp_path, "write", mode="cache", teacher_cache=cache, **common), progress=False)
    assert written["complete"]
    changed = str(tmp_path / "changed.npy")
    save_token_documents(changed, from_lists([documents[1], documents[0], *documents[2:]]))
    with pytest.raises(Exception, match="teacher_cache: .*data_hash"):
        run(_tiny(tmp_path, "refused", teacher_cache=cache, data_path=changed, attention="eager"), progress=False)
    live = run(_tiny(tmp_path, "live", placement="fused", **common), progress=False, return_parameters=True)
    cached = run(_tiny(tmp_path, "cached", teacher_cache=cache, **common), progress=False, return_parameters=True)
    live_rows, cached_rows = read_rows(live["metrics"]), read_rows(cached["metrics"])
    assert [row["step"] for row in cached_rows] == list(range(4))
    for got, expected in zip(cached_rows, live_rows):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=0)
    assert torch.allclose(cached["student_parameters"][0], live["student_parameters"][0], rtol=1e-5, atol=1e-7)
