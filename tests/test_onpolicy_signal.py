"""One on-policy step's learning signal against a direct float64 computation: the rollout worker's
samples (left-padded generation, a stop token ending one of them), laid out as the driver lays
them out (`OnPolicySession.response_batches`: right padding, OPSD teacher prompts of other
lengths), scored by the teacher at the response rows and trained by the student's loss, equal
the full-vocab divergence of the two models' logits at the response positions, computed sample
by sample without padding. No Ray: the workers are built as plain objects."""
from types import SimpleNamespace

import pytest
import torch

from orchestration.chat_data import ChatRecord
from orchestration.config import load_config
from orchestration import onpolicy
from orchestration.onpolicy import OnPolicySession, Sample, reverse_kl_sums
from orchestration.rollout import SamplingParams
from orchestration.rollout_actor import RolloutActor
from orchestration.student import StudentWorker
from orchestration.teacher import TeacherWorker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VOCAB = 50  # the built models' lm_heads have 64 rows: 14 padding rows that are no token
STUDENT_PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17, 18, 19]]
TEACHER_PROMPTS = [[20, 21], [22, 23, 24, 25, 26, 27], [10, 11, 12, 13, 14, 15, 16], [28]]  # OPSD: other prompts


def _config(tmp_path, **options):
    values = dict(device="cpu", student_hidden=16, student_layers=2, teacher_hidden=32, teacher_layers=1, heads=2,
                  row_tokens=32, k=VOCAB, support="tail", divergence="reverse_kl", temperature=1.5,
                  gen_temperature=0.0, max_new_tokens=6, max_prompt_tokens=8, rows_per_micro_batch=4, micro_batches=1)
    values.update(options)
    return load_config(None, [f"output_dir={tmp_path}"] + [f"{key}={value}" for key, value in values.items()])


@torch.no_grad()
def _log_probs(model, prompt, response, temperature):
    """``[len(response), VOCAB]`` float64 log-softmax at ``temperature`` of the rows that predict
    each response token, from one unpadded forward."""
    logits = model(input_ids=torch.tensor([list(prompt) + list(response)])).logits[0].double()
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(response), :VOCAB]
    return torch.log_softmax(rows / temperature, dim=-1)


def _reverse_kl(student_model, teacher_model, samples, temperature):
    """(Σ over response tokens of KL(student ‖ teacher) over the whole vocab, tokens)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for sample in samples:
        response = sample.response
        log_q = _log_probs(student_model, STUDENT_PROMPTS[sample.record], response, temperature)
        log_p = _log_probs(teacher_model, TEACHER_PROMPTS[sample.record], response, temperature)
        total += (log_q.exp() * (log_q - log_p)).sum()
        count += len(response)
    return total, count


def _binned_reverse_kl(student_model, teacher_model, samples, k):
    """Σ over response tokens of KL(student ‖ teacher) over k + 1 bins: the teacher's k most
    likely ids and the rest of the vocab, at temperature 1."""
    total = torch.zeros((), dtype=torch.float64)
    for sample in samples:
        q = _log_probs(student_model, STUDENT_PROMPTS[sample.record], sample.response, 1.0).exp()
        p = _log_probs(teacher_model, TEACHER_PROMPTS[sample.record], sample.response, 1.0).exp()
        for q_row, p_row in zip(q, p):
            top = p_row.argsort(descending=True)[:k]
            q_bins = torch.cat([q_row[top], (1 - q_row[top].sum()).reshape(1)])
            p_bins = torch.cat([p_row[top], (1 - p_row[top].sum()).reshape(1)])
            total += (q_bins * (q_bins.log() - p_bins.log())).sum()
    return total


def test_an_on_policy_steps_loss_is_the_full_vocab_divergence_at_the_response_positions(tmp_path, monkeypatch):
    config = _config(tmp_path)
    student, teacher = StudentWorker(config, VOCAB), TeacherWorker(config, VOCAB)
    rollout = RolloutActor(config, VOCAB, 0)
    # the rollouts start at weight version 0 without a sync: their weights must be the student's
    for (name, mine), theirs in zip(student.model.state_dict().items(), rollout.model.state_dict().values()):
        assert torch.equal(mine, theirs), name

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    stop = int(rollout.generate(STUDENT_PROMPTS, greedy).response_ids[0, 2])
    generated = rollout.generate(STUDENT_PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                 stop_token_ids=(stop,)))
    samples = [Sample(record, tuple(response), generated.weight_version)
               for record, response in enumerate(generated.responses())]
    assert len(samples[0].response) <= 3 and samples[0].response[-1] == stop  # the stop token ends it, kept
    assert len({len(sample.response) for sample in samples}) > 1

    prompts = SimpleNamespace(prompts=lambda index: (STUDENT_PROMPTS[index], TEACHER_PROMPTS[index]),
                              records=[ChatRecord((), None, None, True, f"record {i}") for i in range(4)])
    session = SimpleNamespace(config=config, pad_id=0)
    [batch] = OnPolicySession.response_batches(session, samples, prompts)
    tokens = sum(len(sample.response) for sample in samples)
    assert batch.labels.tolist() == [token for sample in samples for token in sample.response]

    # greedy samples: each one is the argmax of the student's training forward at its row
    row_log_probs = student.row_log_probs(batch.student_tokens, batch.student_rows)
    assert torch.equal(row_log_probs.argmax(-1), batch.labels)

    top = teacher.entries(batch.teacher_tokens, rows=batch.teacher_rows)
    loss, metrics = student.loss(batch.student_tokens, batch.labels, top, tokens, rows=batch.student_rows,
                                 ce_weight=0.0)
    expected, count = _reverse_kl(student.model, teacher.model, samples, config.temperature)
    assert count == tokens and float(metrics["rows"]) == tokens
    torch.testing.assert_close(loss.double(), expected / tokens, rtol=2e-5, atol=1e-7)

    # the driver's measurement (`OnPolicySession.teacher_reverse_kl`): temperature 1, over the whole
    # vocab and over the teacher's top-k bins and its tail
    teacher_log_probs = teacher.row_log_probs(batch.teacher_tokens, batch.teacher_rows)
    whole, binned = reverse_kl_sums(row_log_probs, teacher_log_probs, k=5)
    torch.testing.assert_close(torch.tensor(whole, dtype=torch.float64),
                               _reverse_kl(student.model, teacher.model, samples, 1.0)[0], rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(binned, dtype=torch.float64),
                               _binned_reverse_kl(student.model, teacher.model, samples, 5), rtol=2e-5, atol=1e-7)
    assert binned < whole

    # the same through the driver's final evaluation, which takes 3 rows of log-probs a call
    monkeypatch.setattr(onpolicy, "EVAL_LOG_PROB_BYTES", 8 * VOCAB * 3)
    workers = {"student-0": student, "teacher-0": teacher}
    driver = SimpleNamespace(config=config, pad_id=0, data=SimpleNamespace(vocab=VOCAB), held_prompts=prompts,
                             students=["student-0"], teachers=["teacher-0"], sync_and_generate=lambda *args: (None, {}),
                             collect=lambda *args: samples, get=lambda calls, when: calls,
                             actors=SimpleNamespace(call=lambda worker, method, *args: getattr(workers[worker],
                                                                                                method)(*args)))
    driver.response_batches = lambda *args: OnPolicySession.response_batches(driver, *args)
    mean, mean_binned, counted = OnPolicySession.teacher_reverse_kl(driver, 1)
    assert counted == tokens
    assert mean * tokens == pytest.approx(whole, rel=1e-12)
    assert mean_binned * tokens == pytest.approx(reverse_kl_sums(row_log_probs, teacher_log_probs, VOCAB)[1],
                                                 rel=1e-12)
