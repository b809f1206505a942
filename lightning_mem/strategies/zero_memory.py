"""How much memory ZeRO model states take per GPU and on the host, before a run.

Two accountings, both for mixed-precision Adam, and both without activations:

* ``params_bytes`` / ``grads_bytes`` / ``optimizer_bytes``: the ZeRO paper's split of
  16 bytes per parameter (2 for 16-bit weights, 2 for 16-bit gradients, 12 for the fp32 master
  weights and the two Adam moments), divided by the number of GPUs where the stage shards them,
  and 0 where the tier offloads them to the host.
* ``deepspeed_gpu_bytes`` / ``deepspeed_cpu_bytes``: DeepSpeed's own estimators
  (``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``),
  which count an fp32 gradient copy too (18 bytes per sharded parameter), the largest layer
  gathered whole at stage 3, and a 1.5x allowance on host buffers. Use these to size hardware.

Run ``python -m lightning_mem.strategies.zero_memory`` to print the table in docs/deepspeed.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# Mixed-precision Adam, per parameter.
PARAM_BYTES = 2  # 16-bit weights
GRAD_BYTES = 2  # 16-bit gradients
OPTIMIZER_BYTES = 12  # fp32 master weights + exp_avg + exp_avg_sq
# DeepSpeed's estimators: 16-bit grads + fp32 grads + fp32 weights + Adam moments.
DEEPSPEED_SHARDED_BYTES = 2 + 4 + 4 + 8
# A gathered layer at stage 3: its 16-bit weights and 16-bit gradients.
GATHERED_LAYER_BYTES = 4
DEEPSPEED_BUFFER_FACTOR = 1.5

GIB = 1024**3


@dataclass(frozen=True)
class ZeroMemoryEstimate:
    """Model-state memory of one ZeRO tier. Bytes; per GPU unless named ``cpu``."""

    num_params: int
    num_gpus: int
    stage: int
    offload_optimizer: bool
    offload_params: bool
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    deepspeed_gpu_bytes: int
    deepspeed_cpu_bytes: int  # per node

    @property
    def model_states_bytes(self) -> int:
        """params + grads + optimizer per GPU, by the ZeRO paper's accounting."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def zero_memory_estimate(
    num_params: int,
    *,
    stage: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    largest_layer_params: int | None = None,
    zero_init: bool = True,
    buffer_factor: float = DEEPSPEED_BUFFER_FACTOR,
) -> ZeroMemoryEstimate:
    """Estimate ZeRO model-state memory for ``num_params`` parameters.

    Args:
        num_params: parameters counted once (tied embeddings once).
        stage: 2 or 3.
        num_gpus_per_node, num_nodes: the data-parallel world is their product.
        offload_optimizer: optimizer state (and with it the gradient partitions) on the host.
        offload_params: 16-bit parameter shards on the host; stage 3 only.
        largest_layer_params: parameters of the largest module that owns parameters directly
            (usually the embedding or the LM head); required at stage 3, where that module is
            gathered whole on every GPU.
        zero_init: the model is built under ``deepspeed.zero.Init`` (stage 3), so no process
            ever holds the whole model on the host.
        buffer_factor: DeepSpeed's allowance for host buffers.
    """
    _validate(num_params, stage, num_gpus_per_node, num_nodes, offload_params, largest_layer_params)
    world = num_gpus_per_node * num_nodes
    params, grads, optimizer = _model_states_per_gpu(num_params, stage, world, offload_optimizer, offload_params)
    if stage == 2:
        cpu, gpu = _deepspeed_zero2(num_params, num_gpus_per_node, num_nodes, offload_optimizer, buffer_factor)
    else:
        assert largest_layer_params is not None  # _validate
        cpu, gpu = _deepspeed_zero3(
            num_params,
            largest_layer_params,
            num_gpus_per_node,
            num_nodes,
            offload_optimizer,
            offload_params,
            zero_init,
            buffer_factor,
        )
    return ZeroMemoryEstimate(
        num_params=num_params,
        num_gpus=world,
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        deepspeed_gpu_bytes=gpu,
        deepspeed_cpu_bytes=cpu,
    )


def _model_states_per_gpu(
    num_params: int, stage: int, world: int, offload_optimizer: bool, offload_params: bool
) -> tuple[int, int, int]:
    # Stage 2 keeps the full 16-bit weights on every GPU; stage 3 shards them too.
    params = 0 if offload_params else (num_params * PARAM_BYTES if stage == 2 else num_params * PARAM_BYTES // world)
    # With the optimizer offloaded, each rank's reduced gradient partition goes to the host,
    # where the optimizer steps.
    grads = 0 if offload_optimizer else num_params * GRAD_BYTES // world
    optimizer = 0 if offload_optimizer else num_params * OPTIMIZER_BYTES // world
    return params, grads, optimizer


def _deepspeed_zero2(
    num_params: int, gpus_per_node: int, nodes: int, offload_optimizer: bool, buffer_factor: float
) -> tuple[int, int]:
    world = gpus_per_node * nodes
    if offload_optimizer:
        gpu = PARAM_BYTES * num_params
        cpu = num_params * max(4 * world, 16) * buffer_factor
    else:
        gpu = PARAM_BYTES * num_params + int(DEEPSPEED_SHARDED_BYTES * num_params / world)
        cpu = num_params * 4 * gpus_per_node * buffer_factor
    return int(cpu), int(gpu)


def _deepspeed_zero3(
    num_params: int,
    largest_layer_params: int,
    gpus_per_node: int,
    nodes: int,
    offload_optimizer: bool,
    offload_params: bool,
    zero_init: bool,
    buffer_factor: float,
) -> tuple[int, int]:
    world = gpus_per_node * nodes
    per_node = 1 / nodes
    gathered = GATHERED_LAYER_BYTES * largest_layer_params
    if offload_optimizer and offload_params:
        gpu = gathered
        host_bytes_per_param = 18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node)
        cpu = num_params * host_bytes_per_param * buffer_factor
    elif offload_optimizer:
        gpu = gathered + int(PARAM_BYTES * num_params / world)
        host_bytes_per_param = 16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node)
        cpu = num_params * host_bytes_per_param * buffer_factor
    else:
        # DeepSpeed counts parameter offload without optimizer offload like no offload at all.
        gpu = gathered + int(DEEPSPEED_SHARDED_BYTES * num_params / world)
        loaded = largest_layer_params if zero_init else num_params
        cpu = loaded * 4 * gpus_per_node * buffer_factor
    return int(cpu), int(gpu)


def _validate(
    num_params: int,
    stage: int,
    gpus_per_node: int,
    nodes: int,
    offload_params: bool,
    largest_layer_params: int | None,
) -> None:
    if num_params <= 0:
        raise ValueError(f"num_params={num_params!r} must be positive")
    if stage not in (2, 3):
        raise ValueError(f"stage={stage!r}: the estimate covers ZeRO stage 2 or 3")
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"num_gpus_per_node={gpus_per_node!r} and num_nodes={nodes!r} must be at least 1")
    if offload_params and stage != 3:
        raise ValueError("offload_params=True needs stage=3: stage 2 does not shard parameters")
    if stage == 3 and largest_layer_params is None:
        raise ValueError("largest_layer_params is required at stage 3: that layer is gathered whole on every GPU")
    if largest_layer_params is not None and not 0 < largest_layer_params <= num_params:
        raise ValueError(f"largest_layer_params={largest_layer_params!r} must be in 1..num_params")


# The models in the docs table: exact parameter counts of the published configs (computed from
# the Hugging Face configs on the meta device; tied embeddings counted once), and their largest
# layer, the embedding.
DOC_MODELS: dict[str, tuple[int, int]] = {
    "Qwen2.5-1.5B": (1_543_714_304, 151_936 * 1_536),
    "Llama-3.1-8B": (8_030_261_248, 128_256 * 4_096),
}
# (stage, offload_optimizer, offload_params, label)
DOC_TIERS: tuple[tuple[int, bool, bool, str], ...] = (
    (2, False, False, "ZeRO-2"),
    (2, True, False, "ZeRO-2 + optimizer offload"),
    (3, False, False, "ZeRO-3"),
    (3, True, False, "ZeRO-3 + optimizer offload"),
    (3, True, True, "ZeRO-3 + optimizer + param offload"),
)
DOC_GPU_COUNTS = (1, 8)


def zero_memory_table(
    models: dict[str, tuple[int, int]] = DOC_MODELS,
    tiers: tuple[tuple[int, bool, bool, str], ...] = DOC_TIERS,
    gpu_counts: tuple[int, ...] = DOC_GPU_COUNTS,
) -> str:
    """A Markdown table of :func:`zero_memory_estimate` for ``models`` x ``gpu_counts`` x ``tiers``
    (one node), in GiB."""
    lines = [
        "| model | GPUs | tier | params/GPU | grads/GPU | optimizer/GPU | sum/GPU | DeepSpeed est. GPU | DeepSpeed est. host |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (num_params, largest_layer) in models.items():
        for gpus in gpu_counts:
            for stage, offload_optimizer, offload_params, label in tiers:
                est = zero_memory_estimate(
                    num_params,
                    stage=stage,
                    num_gpus_per_node=gpus,
                    offload_optimizer=offload_optimizer,
                    offload_params=offload_params,
                    largest_layer_params=largest_layer,
                )
                cells = [
                    est.params_bytes,
                    est.grads_bytes,
                    est.optimizer_bytes,
                    est.model_states_bytes,
                    est.deepspeed_gpu_bytes,
                    est.deepspeed_cpu_bytes,
                ]
                lines.append(f"| {name} | {gpus} | {label} | " + " | ".join(f"{c / GIB:.1f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(zero_memory_table(), end="")
