"""The student across the student workers: sharded with FSDP2 or whole replicas; its AdamW, its
gradient clipping, and its checkpoints.

Strategies (`parallelize_student`):

- ``"fsdp"``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer (the classes the
  model names in ``_no_split_modules``), on the input embedding when it is not tied, then on
  the root, the `DistillationStudent`. Parameters, gradients and AdamW state are sharded over
  the group; each unit's parameters are all-gathered for its forward and again for its
  backward, and its gradients reduce-scattered as soon as its backward ends (overlapped with
  the backward of the layers below it: FSDP2's default). With ``compute_dtype=torch.bfloat16``
  (GPUs) ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: bf16 compute,
  float32 sharded master weights, gradients and optimizer state; None (CPU) computes in the
  parameters' dtype.
- ``"replicate"``: every worker holds the whole model and its optimizer state;
  `synchronize_gradients` all-reduces all gradients in one flat collective after the step's
  backward passes. For tiny models, where FSDP's per-unit collectives cost more than they save.

Either way the gradients are SUMMED over the ranks (FSDP2's divide factor is set to 1): with
each rank's loss normalized by the step's global token count, N ranks on a global batch step
exactly like one process on all of it.

The lm_head under FSDP2: the fused loss needs the whole output embedding ``[V, H]``. It is a
parameter of the root unit (with the final norm, and the input embedding when tied), and the
loss runs inside the root's forward (`DistillationStudent.forward`), so FSDP2 all-gathers it
in the root's pre-forward and the loss receives the unsharded parameter; its gradient
accumulates into the unsharded gradient and is reduce-scattered in the root's post-backward,
the last of the step. No DTensor reaches the kernels and no copy is made outside autograd.
Memory: the root's parameters stay gathered from the start of the forward to the end of the
backward (FSDP2 does not reshard the root after forward): ``V · H`` elements of weight in
``compute_dtype``, and at the root's post-backward its unsharded gradient (``compute_dtype``)
with a float32 copy for the reduce-scatter (``reduce_dtype``); at V = 151,936 in bf16:
260 MiB held + 260 + 519 MiB at the end of the backward for H = 896 (Qwen2.5-0.5B), 445 MiB
+ 445 + 890 MiB for H = 1536 — besides the shards. The alternative, a vocab-parallel loss
(``group=`` of ``kd.topk_divergence``) over the lm_head's row shards, would save that at one
all-reduce of row statistics per chunk; it needs the lm_head sharded by rows in its own unit
that is never gathered, and is not done here.

Activation checkpointing (``activation_checkpointing=True``) recomputes each decoder layer in
the backward (Hugging Face's ``activation_checkpointing_enable``, formerly
``gradient_checkpointing_enable``, non-reentrant): the activations kept are the layers'
inputs. FSDP2 gathers the layer's parameters once for the recomputation and the backward.

Checkpoints: `save_checkpoint` / `load_checkpoint` write and read a sharded
``torch.distributed.checkpoint`` directory (model and optimizer through
``get_state_dict`` / ``set_state_dict``, each rank its shards) that loads onto any number of
ranks; `full_model_state_dict` gathers the whole model onto rank 0's CPU for export
(`hf_models.export_causal_lm`).
"""
from __future__ import annotations

import pickle
from typing import Optional

import torch

STRATEGIES = ("fsdp", "replicate")


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _named_layers(causal_lm) -> list:
    names = set(getattr(causal_lm, "_no_split_modules", None) or ())
    # by the class or a base (fully_shard subclasses each unit it wraps)
    return [module for module in causal_lm.modules() if any(base.__name__ in names for base in type(module).__mro__)]


def names_decoder_layers(causal_lm) -> bool:
    """Whether the Hugging Face model names its decoder layer class (`decoder_layers` finds some)."""
    return bool(_named_layers(causal_lm))


def decoder_layers(causal_lm) -> list:
    """The decoder layers of a Hugging Face model: modules whose class is in ``_no_split_modules``."""
    layers = _named_layers(causal_lm)
    if not layers:
        names = sorted(getattr(causal_lm, "_no_split_modules", None) or ())
        raise TypeError(f"model: {type(causal_lm).__name__} names no decoder layer class in _no_split_modules "
                        f"({names}); FSDP2 and compile=true work layer by layer (student_strategy=replica and "
                        f"compile=false run it whole)")
    return layers


def _tied(causal_lm) -> bool:
    head, embedding = causal_lm.get_output_embeddings(), causal_lm.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def parallelize_student(student: torch.nn.Module, *, strategy: str = "fsdp", group=None,
                        compute_dtype: Optional[torch.dtype] = None, activation_checkpointing: bool = False,
                        reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shards (``"fsdp"``) or keeps whole (``"replicate"``) a `DistillationStudent` over
    ``group`` (None: the default group; one process without torch.distributed for replicate).

    Every rank must pass the same initial weights. Returns the student (FSDP2 changes its
    class in place; its parameters become DTensors). See the module docstring.
    ``reshard_after_forward`` (FSDP2's): False keeps each layer gathered from its forward to
    its backward, one all-gather fewer per layer for a whole model's worth of memory.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    if compute_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"compute_dtype: expected None, torch.bfloat16, torch.float16 or torch.float32, got "
                         f"{compute_dtype!r}")
    causal_lm = student.causal_lm
    if activation_checkpointing:
        if not getattr(causal_lm, "supports_gradient_checkpointing", False):
            raise ValueError(f"activation_checkpointing: {type(causal_lm).__name__} does not support gradient "
                             "checkpointing")
        enable = getattr(causal_lm, "activation_checkpointing_enable", None)  # transformers >= 5.x
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if strategy == "replicate":
        return student
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("strategy='fsdp': join a process group first (torch.distributed.init_process_group)")
    device_type = next(student.parameters()).device.type
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = decoder_layers(causal_lm)
    if not _tied(causal_lm):
        units.append(causal_lm.get_input_embeddings())
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(student, mesh=mesh, mp_policy=policy)
    for unit in units + [student]:
        unit.set_gradient_divide_factor(1.0)  # sums, not means (see the module docstring)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: PREMUL_SUM is NCCL-only
    return student


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: torch.nn.Module) -> None:
    """Frees every gathered FSDP2 parameter of ``model``: call it after a forward without a
    backward (evaluation under no_grad), after which FSDP2 keeps the root's parameters
    gathered. Nothing for replicas."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def synchronize_gradients(model: torch.nn.Module, group=None) -> None:
    """Sums the gradients over ``group`` after the step's last backward: one flat all-reduce
    for replicas; nothing under FSDP2, whose backward reduce-scattered them already."""
    if _is_sharded(model) or _group_size(group) == 1:
        return
    import torch.distributed as dist

    parameters = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for parameter, grad in zip(parameters, grads):
        parameter.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
        offset += grad.numel()


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clips the global gradient norm (over every shard) to ``max_norm``; returns the norm
    before clipping, a 0-dim float32 tensor on the gradients' device (no host sync: read it
    with the step's other values)."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (ndim >= 2, embeddings included), none on
    vectors (norm weights) and biases."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim < 2 or name.endswith(".bias") else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `parameter_groups` (after `parallelize_student`: it sees the shards), fused
    on CUDA. Its state has the parameters' dtype: float32 for float32 master weights."""
    if weight_decay < 0 or not all(0 <= beta < 1 for beta in betas) or lr <= 0 or eps <= 0:
        raise ValueError(f"optimizer: expected lr > 0, weight_decay >= 0, 0 <= betas < 1, eps > 0; got lr={lr}, "
                         f"weight_decay={weight_decay}, betas={betas}, eps={eps}")
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)


def save_checkpoint(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    extra: Optional[dict] = None, group=None) -> None:
    """Writes model and optimizer state as a sharded ``torch.distributed.checkpoint`` in
    ``directory`` (every rank of ``group`` calls it). ``extra``: picklable values equal on every
    rank (scheduler state, step, data position), stored once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    # pickled into one leaf: DCP would otherwise load only the keys the loader already knows
    dcp.save({"model": model_state, "optimizer": optimizer_state, "extra": pickle.dumps(dict(extra or {}))},
             checkpoint_id=directory, process_group=group)


def load_checkpoint(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    group=None) -> dict:
    """Loads what `save_checkpoint` wrote into ``model`` and ``optimizer`` (any number of ranks,
    either strategy); returns its ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "extra": b""}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return pickle.loads(state["extra"])


def full_model_state_dict(student: torch.nn.Module) -> dict:
    """The causal LM's whole state dict (keys as ``student.causal_lm.state_dict()``'s) on rank 0's
    CPU, empty on other ranks under FSDP2 (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "causal_lm."
    return {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
