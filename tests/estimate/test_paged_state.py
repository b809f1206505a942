"""The estimate of a paged optimizer: its managed state off the device count, one parameter's pages on it.

bitsandbytes' paged optimizers keep each state buffer of a tensor of at least 100,000 elements in CUDA
managed memory, which ``max_memory_allocated`` does not count and the driver moves to the host when the
card runs short. The estimate (made on a CPU, where the optimizer runs unpaged) counts those buffers on
the host and adds the largest parameter's to the train phase: the pages its update needs on the device.
"""

from __future__ import annotations

import pytest

from lightning_mem.estimate import estimate
from lightning_mem.estimate.measure import filling_rows
from lightning_mem.estimate.recorder import PAGED_MIN_NUMEL
from tests.helpers import REPO

CONFIG = REPO / "configs" / "sft" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    rows = filling_rows(tmp_path_factory.mktemp("rows"))["sft"]
    common = [*rows, "--trainer.callbacks=[]", "--model.optimizer.init_args.lr=1e-3"]
    plain = estimate(CONFIG, [*common, "--model.optimizer=bitsandbytes.optim.AdamW8bit"])
    paged = estimate(CONFIG, [*common, "--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"])
    return plain, paged


def _paged_sizes() -> list[int]:
    """Bytes of the paged buffers (two uint8 codes per element) of each tensor big enough to page."""
    from lightning_mem.models import load_causal_lm

    model = load_causal_lm(str(REPO / "assets" / "tiny-llama"), dtype="float32")
    return [2 * p.numel() for p in model.parameters() if p.numel() >= PAGED_MIN_NUMEL]


def test_paged_state_leaves_the_device_but_one_parameters_pages(pair):
    plain, paged = pair
    sizes = _paged_sizes()
    assert sizes, "the tiny model has tensors big enough to page"
    (before,), (after,) = plain.phases, paged.phases
    # Exactly the managed buffers leave the device, and the largest parameter's come back for its update.
    assert before.device_breakdown_bytes["optimizer_state"] - after.device_breakdown_bytes["optimizer_state"] == (
        sum(sizes) - max(sizes))
    assert after.host_peak_bytes - before.host_peak_bytes == sum(sizes)
    # The exact managed bytes, however many times the run retags its optimizer state (each phase's end).
    assert paged.paged_state_bytes == sum(sizes) and plain.paged_state_bytes == 0
    note = next(n for n in paged.notes if n.startswith("paged optimizer state"))
    assert f"{sum(sizes) / 2**30:.2f} GiB" in note
    assert not any(n.startswith("paged optimizer state") for n in plain.notes)
