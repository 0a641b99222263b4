"""The Ray distillation driver, one concern per module:

- `options`: the one table of every option (the loss options from kd.DivergenceOptions);
  `config`: loading (defaults, YAML, --set, GPU defaults) and every check before any work;
  `errors`: what stops a run, each mapped to an exit code by orchestrate.py.
- `data`: documents, tokenizer, packing with labels shifted once; `sampler`: the rows of a step.
- `placement`: device, GPUs, colocated / disaggregated / fused; `process_group`: torch.distributed
  worlds; `transfer`: how teacher top-k reaches the student (one class per mode).
- `models`: building / loading HF causal LMs, hidden states, held-out CE; `workers`: what
  every Ray worker has; `teacher`, `student`: the two workers; `fused`: both in one actor.
- `actors`: named Ray actors, and the name of the one that died; `checkpoint`: atomic,
  verified checkpoints; `metrics`: metrics.jsonl with run segments; `progress`: bars and notes.
- `driver`: the loop; `onpolicy`: the on-policy / GKD loop (`gkd`: the schedule, `chat_data`:
  prompts and responses, `rollout` / `rollout_actor`: the generating workers, `weight_sync` /
  `weight_source`: the trainer -> rollout weight updates, `shared_weights`: a rollout's buffer
  and lock shared with the trainer, `flat_parameters`: parameters as views of one buffer).

It imports only the public kd_kernels API, and nothing in kd_kernels imports it back.
"""
