"""The ZeRO memory estimator against the formulas it implements, and the docs table it makes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lightning_mem.strategies.zero_memory import DOC_MODELS, zero_memory_estimate, zero_memory_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md"
TABLE_BEGIN = "<!-- zero-memory-table:begin -->"
TABLE_END = "<!-- zero-memory-table:end -->"

P = 1_000_000  # parameters
L = 100_000  # largest layer


@pytest.mark.parametrize(
    ("stage", "gpus", "offload_optimizer", "offload_params", "expected"),
    [
        # ZeRO paper: 2 (params) + 2 (grads) + 12 (optimizer) bytes per parameter.
        (2, 1, False, False, (2 * P, 2 * P, 12 * P)),
        (2, 4, False, False, (2 * P, 2 * P // 4, 12 * P // 4)),
        (2, 4, True, False, (2 * P, 0, 0)),
        (3, 4, False, False, (2 * P // 4, 2 * P // 4, 12 * P // 4)),
        (3, 4, True, False, (2 * P // 4, 0, 0)),
        (3, 4, True, True, (0, 0, 0)),
    ],
)
def test_model_states_per_gpu(stage, gpus, offload_optimizer, offload_params, expected) -> None:
    est = zero_memory_estimate(
        P,
        stage=stage,
        num_gpus_per_node=gpus,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        largest_layer_params=L,
    )
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == expected
    assert est.model_states_bytes == sum(expected)
    assert est.num_gpus == gpus


@pytest.mark.parametrize(
    ("kwargs", "gpu", "cpu"),
    [
        # Stage 2, 8 GPUs on one node: 2P + 18P/8 on the GPU; 4 bytes x 8 GPUs x 1.5 on the host.
        ({"stage": 2, "num_gpus_per_node": 8}, 2 * P + 18 * P // 8, int(P * 4 * 8 * 1.5)),
        # Stage 2 offload: 16-bit params only on the GPU; host max(4 x world, 16) x 1.5.
        ({"stage": 2, "num_gpus_per_node": 8, "offload_optimizer": True}, 2 * P, int(P * 32 * 1.5)),
        ({"stage": 2, "num_gpus_per_node": 2, "offload_optimizer": True}, 2 * P, int(P * 16 * 1.5)),
        # Two nodes of 4: the host term counts GPUs per node.
        ({"stage": 2, "num_gpus_per_node": 4, "num_nodes": 2}, 2 * P + 18 * P // 8, int(P * 4 * 4 * 1.5)),
        # Stage 3: the largest layer gathered (4 bytes/param) plus 18 bytes/param sharded.
        ({"stage": 3, "num_gpus_per_node": 4}, 4 * L + 18 * P // 4, int(L * 4 * 4 * 1.5)),
        ({"stage": 3, "num_gpus_per_node": 4, "zero_init": False}, 4 * L + 18 * P // 4, int(P * 4 * 4 * 1.5)),
        ({"stage": 3, "num_gpus_per_node": 4, "offload_optimizer": True}, 4 * L + 2 * P // 4, int(P * 16 * 1.5)),
        (
            {"stage": 3, "num_gpus_per_node": 4, "num_nodes": 2, "offload_optimizer": True, "offload_params": True},
            4 * L,
            int(P * 18 / 2 * 1.5),
        ),
        (
            {"stage": 3, "num_gpus_per_node": 8, "offload_optimizer": True, "offload_params": True, "zero_init": False},
            4 * L,
            int(P * 32 * 1.5),
        ),
    ],
)
def test_deepspeed_totals_follow_deepspeeds_formulas(kwargs, gpu, cpu) -> None:
    est = zero_memory_estimate(P, largest_layer_params=L, **kwargs)
    assert (est.deepspeed_gpu_bytes, est.deepspeed_cpu_bytes) == (gpu, cpu)


def test_headline_numbers_for_an_8b_model_on_one_gpu() -> None:
    params, embedding = DOC_MODELS["Llama-3.1-8B"]
    no_offload = zero_memory_estimate(params, stage=3, largest_layer_params=embedding)
    full_offload = zero_memory_estimate(
        params, stage=3, offload_optimizer=True, offload_params=True, largest_layer_params=embedding
    )
    gib = 1024**3
    # 16 bytes/param does not fit any single GPU; with full offload only the gathered embedding
    # (weights + grads, 4 bytes/param) stays, about 2 GiB, and the host needs 18 x 1.5 bytes/param.
    assert no_offload.model_states_bytes == 16 * params
    assert round(no_offload.model_states_bytes / gib, 1) == 119.7
    assert full_offload.deepspeed_gpu_bytes == 4 * embedding
    assert round(full_offload.deepspeed_gpu_bytes / gib, 2) == 1.96
    assert round(full_offload.deepspeed_cpu_bytes / gib, 1) == 201.9


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 3}, r"largest_layer_params is required"),
        ({"stage": 1}, r"stage=1"),
        ({"stage": 2, "offload_params": True}, r"offload_params=True needs stage=3"),
        ({"stage": 2, "num_gpus_per_node": 0}, r"num_gpus_per_node=0"),
        ({"stage": 3, "largest_layer_params": 2 * P}, r"largest_layer_params=2000000"),
    ],
)
def test_impossible_estimates_fail_naming_the_argument(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        zero_memory_estimate(P, **kwargs)


def test_docs_table_is_generated_from_the_estimator() -> None:
    text = DOCS.read_text()
    assert TABLE_BEGIN in text and TABLE_END in text, f"{DOCS} lost its table markers"
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == zero_memory_table(), (
        "docs/deepspeed.md is out of date: regenerate the table with"
        " `python -m lightning_mem.strategies.zero_memory`"
    )


def test_matches_deepspeeds_own_estimators() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for params, largest in [(P, L), *DOC_MODELS.values()]:
        for gpus, nodes, offload in itertools.product((1, 3, 8), (1, 2), (False, True)):
            ours = zero_memory_estimate(
                params, stage=2, num_gpus_per_node=gpus, num_nodes=nodes, offload_optimizer=offload
            )
            theirs = estimate_zero2_model_states_mem_needs(
                params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=offload
            )
            assert (ours.deepspeed_cpu_bytes, ours.deepspeed_gpu_bytes) == theirs
            for offload_params, zero_init in itertools.product((False, True), (False, True)):
                if offload_params and not offload:
                    continue  # DeepSpeed's estimator has no such case
                ours = zero_memory_estimate(
                    params,
                    stage=3,
                    num_gpus_per_node=gpus,
                    num_nodes=nodes,
                    offload_optimizer=offload,
                    offload_params=offload_params,
                    largest_layer_params=largest,
                    zero_init=zero_init,
                )
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    params,
                    largest,
                    num_gpus_per_node=gpus,
                    num_nodes=nodes,
                    cpu_offload=offload,
                    cpu_offload_params=offload_params,
                    zero_init=zero_init,
                )
                assert (ours.deepspeed_cpu_bytes, ours.deepspeed_gpu_bytes) == (cpu, gpu)
