"""The rollout worker: batched KV-cached generation against a full-recompute loop, stop tokens and
masks, seeded sampling, and generation against weight updates (threads in one process)."""
import threading
import time

import pytest
import torch

from helpers import tiny_llama
from orchestration.flat_parameters import flat_region, flatten_parameters
from orchestration.rollout import RolloutWorker, SamplingParams, response_mask
from orchestration.shared_weights import WeightLock, map_shared
from orchestration.weight_sync import WeightPusher, WeightSender

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
TOKENS = torch.tensor([[3, 17, 42, 5, 88, 1, 9, 60]])


@torch.no_grad()
def _greedy_by_recompute(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_generation_equals_a_full_recompute_loop():
    model = tiny_llama(3)
    rollout = RolloutWorker(model, pad_token_id=0).generate(PROMPTS, GREEDY)
    assert rollout.response_ids.shape == (3, 6) and rollout.response_ids.dtype == torch.long
    assert rollout.lengths.tolist() == [6, 6, 6] and bool(rollout.response_mask.all())
    assert rollout.responses() == [_greedy_by_recompute(model, prompt, 6) for prompt in PROMPTS]
    assert rollout.weight_version == 0


def test_a_stop_token_ends_the_response_and_masks_the_rest():
    worker = RolloutWorker(tiny_llama(3), pad_token_id=0)
    unstopped = worker.generate(PROMPTS, GREEDY).response_ids
    stop = int(unstopped[0, 2])
    rollout = worker.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    for row, full in enumerate(unstopped.tolist()):
        length = full.index(stop) + 1 if stop in full else 6
        assert rollout.lengths[row] == length
        assert rollout.response_ids[row].tolist() == full[:length] + [0] * (6 - length)
        assert rollout.response_mask[row].tolist() == [True] * length + [False] * (6 - length)
    assert rollout.lengths[0] <= 3
    tokens = torch.tensor([[4, 9, 4, 9], [1, 2, 3, 4]])
    assert response_mask(tokens, [9]).tolist() == [[True, True, False, False], [True] * 4]
    assert response_mask(tokens, []).all()


def test_sampling_is_reproducible_from_its_seed_and_leaves_the_global_generator_alone():
    worker = RolloutWorker(tiny_llama(3), pad_token_id=0)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    state = torch.get_rng_state()
    first = worker.generate(PROMPTS, sampled).response_ids
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(worker.generate(PROMPTS, sampled).response_ids, first)
    assert not torch.equal(worker.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=8)).response_ids, first)
    top_one = worker.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, seed=3))
    assert torch.equal(top_one.response_ids, worker.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0)).response_ids)


@pytest.mark.parametrize("field, value, message", [("max_new_tokens", 0, "max_new_tokens: expected an int >= 1"),
                                                   ("temperature", -1.0, "temperature: expected >= 0"),
                                                   ("top_p", 0.0, "top_p: expected a value in \\(0, 1\\]"),
                                                   ("top_k", -2, "top_k: expected an int >= 0"),
                                                   ("stop_token_ids", (-1,), "stop_token_ids: expected token ids")])
def test_sampling_params_refuse_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def _slow_update(worker, sender, weight_version, requested, log):
    """pause → flush → every bucket, each after a delay → continue, logging the times."""
    worker.pause_generation()
    worker.flush_cache()
    log["paused"] = time.perf_counter()
    requested.wait()
    time.sleep(0.1)  # the generation request is now waiting inside generate
    for index, bucket in enumerate(sender.buckets):
        time.sleep(0.02)
        worker.update_weights_from_tensor(bucket.names, bucket.dtypes, bucket.shapes, sender.pack(index),
                                          weight_version)
    log["updated"] = time.perf_counter()
    worker.continue_generation()


def test_a_generation_requested_during_an_update_waits_and_sees_the_whole_new_model():
    trainer = tiny_llama(1)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    sender = WeightSender(trainer, bucket_bytes=4096)
    assert len(sender.buckets) > 5
    before = worker.generate(PROMPTS, GREEDY).responses()
    expected = RolloutWorker(tiny_llama(1), pad_token_id=0).generate(PROMPTS, GREEDY).responses()
    assert before != expected
    requested, log, results = threading.Event(), {}, {}

    def generation():
        log["requested"] = time.perf_counter()
        requested.set()
        results["rollout"] = worker.generate(PROMPTS, GREEDY)
        log["generated"] = time.perf_counter()

    updater = threading.Thread(target=_slow_update, args=(worker, sender, 1, requested, log))
    updater.start()
    while "paused" not in log:
        time.sleep(0.005)
    generator = threading.Thread(target=generation)
    generator.start()
    updater.join()
    generator.join()
    assert log["paused"] < log["requested"] < log["updated"] < log["generated"]
    assert results["rollout"].weight_version == 1
    assert results["rollout"].responses() == expected


def test_pause_waits_for_the_running_generation():
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    expected = worker.generate(PROMPTS, GREEDY).responses()
    started, forwards, results = threading.Event(), [], {}

    def slow_forward(module, args, output):
        started.set()
        time.sleep(0.03)
        forwards.append(time.perf_counter())

    handle = worker.model.register_forward_hook(slow_forward)
    thread = threading.Thread(target=lambda: results.update(rollout=worker.generate(PROMPTS, GREEDY)))
    thread.start()
    started.wait()
    worker.pause_generation()
    paused = time.perf_counter()
    thread.join()
    handle.remove()
    assert len(forwards) == GREEDY.max_new_tokens and forwards[-1] < paused  # it waited for the last forward
    assert results["rollout"].responses() == expected and results["rollout"].weight_version == 0
    worker.continue_generation()


def test_a_whole_update_waits_for_the_running_generation_and_the_next_one_sees_all_of_it():
    """`update_weights_from_tensor(..., whole_update=True)`, one call: a generation running when it
    arrives ends on the old weights first; one requested while it copies waits and runs on the
    whole new model."""
    trainer = tiny_llama(1)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    before = worker.generate(PROMPTS, GREEDY).responses()
    expected = RolloutWorker(tiny_llama(1), pad_token_id=0).generate(PROMPTS, GREEDY).responses()
    assert before != expected
    started, copying, forwards, results, log = threading.Event(), threading.Event(), [], {}, {}

    def slow_forward(module, args, output):
        started.set()
        time.sleep(0.02)
        forwards.append(time.perf_counter())

    def slow_rebuild(tensor):  # the receiver maps the handles under its lock, before it copies
        copying.set()
        time.sleep(0.02)
        return tensor

    def requested_during_the_update():
        copying.wait()
        log["requested"] = time.perf_counter()
        results["after"] = worker.generate(PROMPTS, GREEDY)

    named = list(trainer.named_parameters())
    payload = [(slow_rebuild, (parameter.detach(),)) for _, parameter in named]
    handle = worker.model.register_forward_hook(slow_forward)
    running = threading.Thread(target=lambda: results.update(running=worker.generate(PROMPTS, GREEDY)))
    waiting = threading.Thread(target=requested_during_the_update)
    running.start()
    waiting.start()
    started.wait()
    worker.update_weights_from_tensor([n for n, _ in named], [p.dtype for _, p in named],
                                      [tuple(p.shape) for _, p in named], payload, 1, True)
    updated = time.perf_counter()
    running.join()
    waiting.join()
    handle.remove()
    assert forwards[GREEDY.max_new_tokens - 1] < log["requested"] < updated  # the running one ended first
    assert results["running"].weight_version == 0 and results["running"].responses() == before
    assert results["after"].weight_version == 1 and results["after"].responses() == expected


def test_ids_past_the_tokenizers_vocab_are_never_sampled():
    """An lm_head padded past the tokenizer (96 rows, 10 real tokens here): its padding rows are
    masked out of the sampling."""
    worker = RolloutWorker(tiny_llama(3), pad_token_id=0, vocab_size=10)
    rollout = worker.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=2.0, seed=1))
    assert int(rollout.response_ids.max()) < 10
    unmasked = RolloutWorker(tiny_llama(3), pad_token_id=0).generate(PROMPTS, SamplingParams(max_new_tokens=16,
                                                                                              temperature=2.0, seed=1))
    assert int(unmasked.response_ids.max()) >= 10  # the same sampling without the mask reaches them
    with pytest.raises(ValueError, match="vocab_size: expected None or an int >= 1, got 0"):
        RolloutWorker(tiny_llama(3), pad_token_id=0, vocab_size=0)


def test_the_models_own_generation_config_does_not_change_the_samples():
    """A checkpoint's generation_config.json (Qwen's carries repetition_penalty, top_k, an EOS id)
    must not reshape the student's distribution: generation follows `SamplingParams` alone."""
    model = tiny_llama(3)
    plain = _greedy_by_recompute(model, PROMPTS[1], 6)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.eos_token_id = plain[1]  # not a stop token of these SamplingParams
    worker = RolloutWorker(model, pad_token_id=0)
    greedy = worker.generate(PROMPTS, GREEDY)
    assert greedy.responses() == [_greedy_by_recompute(model, prompt, 6) for prompt in PROMPTS]
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    model.generation_config.top_k, model.generation_config.temperature = 1, 0.1
    reference = RolloutWorker(tiny_llama(3), pad_token_id=0).generate(PROMPTS, sampled)
    assert torch.equal(worker.generate(PROMPTS, sampled).response_ids, reference.response_ids)


def test_a_push_waits_for_the_running_generation_and_a_generation_waits_for_a_push():
    """The trainer's push (`WeightPusher`) and a generation exclude each other through the shared
    lock file: a push waits while a generation holds it; a generation requested while a push
    holds it (here half of the new weights written) waits and runs on the whole new model, with
    the version the push published."""
    trainer = tiny_llama(1)
    flatten_parameters(trainer)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    shared = worker.share_weight_buffer()
    pusher = WeightPusher(trainer, shared)
    expected = RolloutWorker(tiny_llama(1), pad_token_id=0).generate(PROMPTS, GREEDY).responses()
    before = worker.generate(PROMPTS, GREEDY).responses()
    assert before != expected

    # a running generation (holding the lock as `generate` does) holds the push back
    holding, release, pushed = threading.Event(), threading.Event(), threading.Event()

    def hold_a_generation():
        with worker._receiver.generation() as version:
            assert version == 0
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold_a_generation)
    holder.start()
    holding.wait()
    pusher_thread = threading.Thread(target=lambda: (pusher.push(1), pushed.set()))
    pusher_thread.start()
    assert not pushed.wait(0.3) and worker.weight_version == 0  # still waiting for the generation
    release.set()
    holder.join()
    pusher_thread.join()
    assert pushed.is_set() and worker.weight_version == 1
    assert worker.generate(PROMPTS, GREEDY).responses() == expected

    # a push in progress (the trainer's lock held, half of the next weights written) holds a generation back
    _perturb_all(trainer)
    following = RolloutWorker(_copy_of(trainer), pad_token_id=0).generate(PROMPTS, GREEDY).responses()
    target, source, results = map_shared(shared), flat_region([p.detach() for p in trainer.parameters()]), {}
    trainers_lock = WeightLock(shared.lock_path)  # the trainer's own open file: excludes within one process too
    with trainers_lock.held():
        half = target.numel() // 2
        target[:half].copy_(source[:half])
        generator = threading.Thread(target=lambda: results.update(rollout=worker.generate(PROMPTS, GREEDY)))
        generator.start()
        generator.join(0.3)
        assert generator.is_alive()  # waiting for the lock
        target[half:].copy_(source[half:])
        trainers_lock.publish(2)
    generator.join()
    assert results["rollout"].weight_version == 2 and results["rollout"].responses() == following
    assert following != expected


def _perturb_all(model):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.5)


def _copy_of(model):
    copy = tiny_llama(0)
    copy.load_state_dict(model.state_dict())
    return copy


def test_the_in_process_update_takes_the_shared_lock_too():
    """Once shared, `pause_generation` holds the lock file until `continue_generation`: a push
    waits for the update, and the update's version is the one published."""
    trainer = tiny_llama(1)
    worker = RolloutWorker(tiny_llama(2), pad_token_id=0)
    pusher = WeightPusher(trainer, worker.share_weight_buffer())
    sender = WeightSender(tiny_llama(3), bucket_bytes=1 << 20)
    worker.pause_generation()
    pushed = threading.Event()
    pusher_thread = threading.Thread(target=lambda: (pusher.push(2), pushed.set()))
    pusher_thread.start()
    for index in range(len(sender.buckets)):
        bucket = sender.buckets[index]
        worker.update_weights_from_tensor(bucket.names, bucket.dtypes, bucket.shapes, sender.pack(index), 1)
    assert not pushed.wait(0.3)
    assert worker.continue_generation()["weight_version"] == 1
    pusher_thread.join()
    assert pushed.is_set() and worker.weight_version == 2
    assert torch.equal(worker.model(TOKENS).logits, trainer(TOKENS).logits)

