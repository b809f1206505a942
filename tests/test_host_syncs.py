"""No device-to-host sync in the SFT training step (forward, backward, clipping, optimizer step),
and between steps only at the steps the logger reads its values.

A CPU has no syncs to time, so the check is structural: every operation that makes the host wait
for the device on an accelerator is counted while the step runs -- reading a value
(``item``/``int``/``float``/``bool``/``tolist``: ``aten._local_scalar_dense``), an output whose size
depends on the values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``...) and
copying a host value to the device (``torch.tensor(value, device=...)``, a blocking copy from
pageable memory). The collate finds the scored positions and counts on the host and they travel
with the batch; the step must then do none of these. The probe is shown to see them: a batch without
the collate's targets makes the recipe find them on the device, and the probe counts that.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mem.cli import RecipeCLI
from lightning_mem.data import SFTDataModule
from recipes.sft import SFTModule
from tests.helpers import REPO

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")

#: aten ops whose result the host must wait for: a value read back, or an output sized by values.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "bincount", "histc", "equal", "is_nonzero"}
#: Indexing ops that sync when an index is a boolean mask (they run nonzero on it).
MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _where() -> str:
    # The innermost frames outside torch and this file: where the recipe (or Lightning) asked for it.
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])


class _DeviceSyncs(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            self.found.append(f"{name} without output_size at {_where()}")
        elif name in SYNC_OPS:
            self.found.append(f"{name} at {_where()}")
        elif name in MASK_INDEXING:
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                self.found.append(f"{name} with a boolean mask at {_where()}")
        return func(*args, **(kwargs or {}))


class _HostCopies(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and not isinstance(args[0] if args else None, torch.Tensor):
            self.found.append(f"torch.{func.__name__}(host value, device=...) at {_where()}")
        elif func is torch.Tensor.tolist:
            self.found.append(f"tolist at {_where()}")
        return func(*args, **kwargs)


class SyncProbe(Callback):
    """What syncs each training batch makes, from its start to its end (progress bar off)."""

    def __init__(self) -> None:
        self.per_batch: list[list[str]] = []
        self._modes: tuple | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.per_batch.append([])
        self._modes = (_HostCopies(self.per_batch[-1]), _DeviceSyncs(self.per_batch[-1]))
        for mode in self._modes:
            mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)


class TargetsOnTheDevice(SFTModule):
    """The recipe given batches without the collate's targets (as from a datamodule of your own)."""

    def training_step(self, batch, batch_idx):
        batch = {k: v for k, v in batch.items() if k not in ("target_positions", "target_ids", "label_tokens")}
        return super().training_step(batch, batch_idx)


class RunProbe(Callback):
    """What syncs the whole training run makes, by the batch that was running (Lightning's own work
    after a batch included: its logger connector and the progress bar)."""

    def __init__(self) -> None:
        self.by_batch: dict[int, list[str]] = {}
        self.steps: dict[int, int] = {}  # batch index -> the global step when it ended
        self._modes: tuple | None = None
        self._found: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._modes = (_HostCopies(self._found), _DeviceSyncs(self._found))
        for mode in self._modes:
            mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.by_batch[batch_idx] = self._found = []  # from here until the next batch starts
        for mode in self._modes:
            mode.found = self._found

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[batch_idx] = trainer.global_step
        self.trainer = trainer

    def on_train_end(self, trainer, pl_module) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)


def _fit(tmp_path, module_class, *extra: str, probe: str = "SyncProbe", bar: bool = False) -> Callback:
    args = [
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        f"--trainer.enable_progress_bar={str(bar).lower()}", f"--trainer.callbacks=tests.test_host_syncs.{probe}",
        "--trainer.precision=bf16-mixed", "--model.optimizer.init_args.fused=true",
        "--model.export_dir=null", "--model.lr_scheduler.init_args.warmup_steps=1", "--data.max_tokens_per_batch=256",
        *extra,
    ]  # fmt: skip
    cli = RecipeCLI(module_class, SFTDataModule, args=args, save_config_kwargs={"overwrite": True})
    (found,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == probe]
    return found


#: Syncs that are not the recipe's: transformers' mask builder reads one value per forward -- whether
#: the padding mask is all ones (then SDPA's own causal mask serves), or, for packed rows (no attention
#: mask), whether the position ids restart. A bare loop or TRL on the same rows does the same.
NOT_OURS = ("masking_utils.py:", "create_causal_mask")


def ours(found: list[str]) -> list[str]:
    return [s for s in found if not all(part in s for part in NOT_OURS)]


def test_sft_training_step_makes_no_host_sync(tmp_path):
    probe = _fit(tmp_path, SFTModule)
    assert len(probe.per_batch) == 2
    assert [ours(found) for found in probe.per_batch] == [[], []]
    assert all(len(found) == 1 for found in probe.per_batch)  # transformers' one, per forward


def test_packed_sft_training_step_makes_no_host_sync(tmp_path):
    probe = _fit(tmp_path, SFTModule, "--data.packing=true")
    assert len(probe.per_batch) == 2
    assert [ours(found) for found in probe.per_batch] == [[], []]
    assert all(len(found) == 1 for found in probe.per_batch)  # transformers' one, per forward


def test_the_probe_sees_targets_found_on_the_device(tmp_path):
    probe = _fit(tmp_path, TargetsOnTheDevice)
    assert all(any("nonzero" in s for s in ours(found)) for found in probe.per_batch), probe.per_batch


#: 6 optimizer steps of 2 micro-batches, the logger's reads every 3 steps, the recipes' progress bar on.
ACCUMULATED_RUN = ("--trainer.max_steps=6", "--trainer.accumulate_grad_batches=2", "--trainer.log_every_n_steps=3")


@pytest.mark.parametrize("bar", ["rich", "tqdm"])
def test_between_batches_the_run_reads_the_device_only_at_log_steps(tmp_path, bar):
    # Lightning reads every prog_bar value back after each batch, bar or no bar; the recipe logs its
    # loss without prog_bar, and the recipes' bar reads it where the logger does: steps 3 and 6.
    # The CLI gives a run the rich bar (rich is installed); tqdm's is the other one it may give.
    tqdm = ["--trainer.callbacks+=lightning_mem.callbacks.progress.StepProgressBar"] if bar == "tqdm" else []
    probe = _fit(tmp_path, SFTModule, *ACCUMULATED_RUN, *tqdm, probe="RunProbe", bar=True)
    shown = [cb for cb in probe.trainer.callbacks if type(cb).__name__.startswith("Step")]
    assert [type(cb).__name__ for cb in shown] == ["StepRichProgressBar" if bar == "rich" else "StepProgressBar"]
    assert set(shown[0]._shown) >= {"train_loss"}  # what the bar shows after the last read
    assert len(probe.by_batch) == 12
    reads = {index: device_reads(found) for index, found in probe.by_batch.items() if device_reads(found)}
    assert sorted(reads) == [5, 11] and [probe.steps[i] for i in sorted(reads)] == [3, 6]  # each ends a log step
    assert all(len(found) == 1 and "progress.py" in found[0] for found in reads.values()), reads


class LossOnTheBar(SFTModule):
    """The recipe logging its loss as Lightning's progress bar metrics are logged (``prog_bar=True``)."""

    def log(self, name, value, *args, **kwargs):
        super().log(name, value, *args, **{**kwargs, "prog_bar": kwargs.get("prog_bar", name == "train_loss")})


def test_the_probe_sees_lightnings_read_of_a_prog_bar_value_after_every_batch(tmp_path):
    probe = _fit(tmp_path, LossOnTheBar, *ACCUMULATED_RUN, probe="RunProbe")  # no bar at all
    assert all(any("to_item" in s for s in device_reads(found)) for found in probe.by_batch.values()), probe.by_batch


def device_reads(found: list[str]) -> list[str]:
    # Between batches the probe also sees the next batch's collate, which searches the host tensors
    # for the targets (data/sft.py, before the batch moves to the device): host work, not a sync.
    return [s for s in ours(found) if "with_targets" not in s]


# ---------------------------------------------------------------------- the RL passes' micro-batches


def _experience():
    from lightning_mem.rl.rollout import experience_from_generation

    pad, eos = 0, 2
    prompt_ids = torch.tensor([[pad, 10, 11], [12, 13, 14], [pad, pad, 15]])
    prompt_mask = (prompt_ids != pad).long()
    sequences = torch.tensor([[pad, 10, 11, 20, eos, pad], [12, 13, 14, 21, 22, 23], [pad, pad, 15, eos, pad, pad]])
    return experience_from_generation(prompt_ids, prompt_mask, sequences, eos_token_ids=[eos], pad_token_id=pad)


def test_experience_select_with_host_lengths_is_the_device_select_without_syncs():
    exp = _experience()
    want = [exp.select(torch.tensor(i)) for i in ([2, 0], [1])]  # no host lengths yet: read on the device
    assert exp.sequence_lengths == [4, 6, 2] and exp.host_lengths[1] == [2, 3, 1]
    found: list[str] = []
    with _HostCopies(found), _DeviceSyncs(found):
        got = [exp.select(i) for i in ([2, 0], [1])]  # the micro-batch plan's host lists
    assert found == []
    for g, w in zip(got, want):
        for name in ("input_ids", "attention_mask", "prompt_lengths", "response_ids", "response_mask", "group_ids"):
            assert torch.equal(getattr(g, name), getattr(w, name)), name
    assert got[0].host_lengths == ([2, 4], [1, 2], [1, 2])  # carried to the micro-batch, in its order
    assert got[0].contiguous_lengths == [1, 2]  # prefix masks: spans and counts agree


def test_response_targets_from_host_lengths_equal_the_device_search():
    from lightning_mem.logits import response_targets

    exp = _experience()
    exp.sequence_lengths  # reads the lengths back once
    lengths = exp.contiguous_lengths
    args = (exp.prompt_lengths, exp.response_ids, exp.response_mask, exp.input_ids.shape[1])
    want = response_targets(*args)
    found: list[str] = []
    with _HostCopies(found), _DeviceSyncs(found):
        got = response_targets(*args, response_lengths=lengths)
    assert found == []
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got[2], want[2]))
    starts = torch.tensor([0, 4, 10])  # a packed row's
    torch.testing.assert_close(response_targets(*args[:3], 0, starts=starts, response_lengths=lengths)[0],
                               response_targets(*args[:3], 0, starts=starts)[0])


# ---------------------------------------------------------------------- the collate's targets


def test_the_collates_targets_give_the_loss_the_device_search_gives():
    from lightning_mem.data.packing import collate_packed
    from lightning_mem.data.sft import collate_right_padded, with_targets
    from tests.test_packing import _examples, _llama, _module

    module = _module(_llama(), chunk_size=7)
    examples = _examples()
    for batch in (collate_right_padded(examples, pad_token_id=0), collate_packed(examples, 32)):
        sent = with_targets(batch)
        assert int(sent["label_tokens"]) == int((batch["labels"][:, 1:] != -100).sum())
        with torch.no_grad():
            (want, want_n), (got, got_n) = module.loss(batch), module.loss(sent)
        assert got_n == want_n == sent["target_ids"].numel()
        assert torch.equal(got, want)
