"""The Ray distillation driver: `config` (embedded default, YAML, --set), `data` (documents,
tokenizer, packing with labels shifted once), `comm_plan` (teacher ↔ student data-parallel
routes), `workers` (teacher and student Ray actors), `driver` (the loop). It imports only
the public kd_kernels API, and nothing in kd_kernels imports it back."""
