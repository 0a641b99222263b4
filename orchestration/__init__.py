"""The Ray driver (teacher workers, student workers, top-k transfer). Not built yet: see
the orchestration issue. `orchestrate.py` runs a single-process distillation until then.
It imports only the public kd_kernels API, and nothing imports it back."""
