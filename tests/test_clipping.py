"""Gradient clipping with torch's fused AdamW (lightning_mem.clipping) under bf16-mixed and bf16-true.

Lightning refuses to clip for an optimizer that unscales inside its step, even where no loss scale
exists (bf16). :class:`~lightning_mem.clipping.ClipsGradients` clips through Lightning's
``configure_gradient_clipping`` hook instead. What holds, on one device and under FSDP2 (1 and 2
gloo ranks), after three steps that all clip (the norm is 60-80 times the clip value):

- the fused optimizer's weights are the foreach optimizer's, to rounding of the precision;
- the one-device weights and norms are Lightning's own clipping's (foreach, which it allows);
- the FSDP2 runs' weights and norms are the one-device run's: the norm is global, not a shard's;
- clipping by value works the same; under an fp16 loss scaler the fused optimizer is refused clearly.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mem import clipping
from lightning_mem.clipping import clip_by_norm, clip_by_value, gradient_norm
from tests.clipping_worker import CLIP, ClippedModule, LightningClipped, fit
from tests.helpers import HANG_GUARD_S, REPO

PRECISIONS = ["bf16-mixed", "bf16-true"]


def tolerance(precision: str) -> dict[str, float]:
    # bf16-true weights are bf16: fused and foreach round their updates differently, by an ulp
    # or two (2**-8 relative); under bf16-mixed the fp32 weights agree to fp32 rounding.
    return dict(rtol=2**-6, atol=4e-3) if precision == "bf16-true" else dict(rtol=1e-6, atol=1e-6)


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def one_device() -> dict[str, dict]:
    runs = {}
    for precision in PRECISIONS:
        for name, module in (("foreach", ClippedModule(False)), ("fused", ClippedModule(True))):
            runs[f"{precision}/{name}"] = fit(module, precision)
        runs[f"{precision}/unclipped"] = fit(ClippedModule(False), precision, clip=0.0)
    return runs


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_adamw_clips_and_equals_foreach_on_one_device(one_device, precision):
    foreach, fused = one_device[f"{precision}/foreach"], one_device[f"{precision}/fused"]
    assert len(fused["norms"]) == 3 and min(fused["norms"]) > 50 * CLIP  # every step clipped
    assert fused["norms"][0] == foreach["norms"][0]  # the same gradients: the same norm
    for name, weight in foreach["weights"].items():
        torch.testing.assert_close(fused["weights"][name], weight, **tolerance(precision))
    # Clipping changed the update, by far more than the tolerance.
    assert max_difference(foreach["weights"], one_device[f"{precision}/unclipped"]["weights"]) > 5e-3


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_clipping_equals_lightnings_own_clipping(one_device, precision):
    ours = one_device[f"{precision}/foreach"] if precision in PRECISIONS else fit(ClippedModule(False), precision)
    lightning = fit(LightningClipped(False), precision)
    for name, weight in lightning["weights"].items():
        torch.testing.assert_close(ours["weights"][name], weight, rtol=1e-6, atol=1e-7)


def test_lightning_alone_refuses_the_fused_optimizer_under_bf16():
    # What the mixin is for: without it, Lightning's plugin raises at the first clip.
    with pytest.raises(RuntimeError, match="performs unscaling of gradients internally"):
        fit(LightningClipped(True), "bf16-mixed")


def test_no_clipping_logs_no_norm(one_device):
    assert one_device["bf16-mixed/unclipped"]["norms"] == []


@pytest.mark.parametrize("precision", PRECISIONS)
def test_clipping_by_value_fused_equals_foreach_and_lightning(precision):
    foreach = fit(ClippedModule(False), precision, algorithm="value", clip=1e-3)
    fused = fit(ClippedModule(True), precision, algorithm="value", clip=1e-3)
    lightning = fit(LightningClipped(False), precision, algorithm="value", clip=1e-3)
    unclipped = fit(ClippedModule(False), precision, clip=0.0)
    assert foreach["norms"] == []  # by value: no norm computed
    for name, weight in foreach["weights"].items():
        torch.testing.assert_close(fused["weights"][name], weight, **tolerance(precision))
        torch.testing.assert_close(lightning["weights"][name], weight, **tolerance(precision))
    assert max_difference(foreach["weights"], unclipped["weights"]) > 5e-3


def fp16_scaler() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_fused_adamw_under_an_fp16_loss_scale_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"trainer.gradient_clip_val.*fused.*model.optimizer.init_args.fused false"):
        fit(ClippedModule(True), None, plugins=[fp16_scaler()])


def test_foreach_under_an_fp16_loss_scale_keeps_lightnings_unscale_then_clip():
    ours = fit(ClippedModule(False), None, plugins=[fp16_scaler()])
    lightning = fit(LightningClipped(False), None, plugins=[fp16_scaler()])
    for name, weight in lightning["weights"].items():
        torch.testing.assert_close(ours["weights"][name], weight, rtol=0, atol=0)


# ---------------------------------------------------------------------- the primitives


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_gradient_norm_is_the_norm_of_all_gradients_together(norm_type):
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(4, 4, generator=g).bfloat16()]
    whole = torch.cat([t.float().flatten() for t in grads])
    want = torch.linalg.vector_norm(whole, norm_type)
    torch.testing.assert_close(gradient_norm(grads, norm_type), want)
    assert gradient_norm(grads, norm_type).dtype == torch.float32


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_a_low_precision_norm_off_cuda_is_taken_in_slices_with_the_same_value(monkeypatch, norm_type):
    # A bf16 gradient larger than a slice: its float32 norm by pieces equals the norm of its float32 copy.
    monkeypatch.setattr(clipping, "NORM_SLICE", 10)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(7, 5, generator=g).bfloat16(), torch.randn(3, generator=g).bfloat16(), torch.randn(23, generator=g)]
    pieces = clipping._norm_inputs(grads[:2], torch.device("cpu"), torch.bfloat16)
    assert [p.numel() for p in pieces] == [10, 10, 10, 5, 3]
    assert all(p.untyped_storage().data_ptr() == grads[i // 4].untyped_storage().data_ptr() for i, p in enumerate(pieces))  # views, not copies
    assert clipping._norm_inputs(grads[2:], torch.device("cpu"), torch.float32) == grads[2:]  # float32: as they are
    want = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in grads]), norm_type)
    torch.testing.assert_close(gradient_norm(grads, norm_type), want)


def test_the_norm_of_a_large_bf16_gradient_allocates_no_float32_copy_of_it():
    # RSS high-water mark around the norm of a 256 MiB bf16 tensor: its float32 copy would add 512 MiB.
    big = torch.ones(1 << 27, dtype=torch.bfloat16)
    clear_refs = Path("/proc/self/clear_refs")
    if not clear_refs.exists():
        pytest.skip("needs Linux's /proc to read the peak RSS")
    def peak() -> int:
        return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    clear_refs.write_text("5")
    before = peak()
    norm = gradient_norm([big])
    assert peak() - before < 64 * 2**20, "the norm made a copy of the gradient"
    torch.testing.assert_close(norm, torch.tensor(float(1 << 27)).sqrt())


def test_clip_by_norm_scales_to_the_bound_and_returns_the_norm_before():
    grads = [torch.full((4,), 3.0), torch.full((9,), 4.0 / 3)]  # norm sqrt(36 + 16) = sqrt(52)
    before = clip_by_norm(grads, 1.0)
    torch.testing.assert_close(before, torch.tensor(52.0).sqrt())
    torch.testing.assert_close(gradient_norm(grads), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    small = [torch.full((4,), 0.1)]
    clip_by_norm(small, 1.0)
    assert torch.equal(small[0], torch.full((4,), 0.1))  # under the bound: unchanged
    values = [torch.tensor([-3.0, 0.5, 2.0])]
    clip_by_value(values, 1.0)
    assert values[0].tolist() == [-1.0, 0.5, 1.0]


# ---------------------------------------------------------------------- FSDP2 on gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> dict[int, dict]:
    """Every precision and optimizer on 1 and on 2 gloo ranks: the ranks started here as torchrun
    would (LOCAL_RANK per process), both spawns at once."""
    folder = tmp_path_factory.mktemp("clipping")
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED")}
    procs = []
    for world in (1, 2):
        spec = folder / f"spec{world}.json"
        spec.write_text(f'{{"world": {world}, "precisions": {PRECISIONS!r}, "out": "{folder / f"world{world}.pt"}"}}'.replace("'", '"'))
        port = _free_port()
        for rank in range(world):
            env = {**inherited, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("clipping_worker.py")), str(spec)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, f"worker failed:\n{out[-6000:]}"
    return {world: torch.load(folder / f"world{world}.pt") for world in (1, 2)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp2_fused_adamw_clips_like_foreach_and_like_one_device(fsdp2, one_device, world, precision):
    for name in ("foreach", "fused"):
        sharded, whole = fsdp2[world][f"{precision}/{name}"], one_device[f"{precision}/{name}"]
        # The global norm: a shard's would be smaller (and differ per rank), and so would the weights.
        torch.testing.assert_close(sharded["norms"], whole["norms"], rtol=1e-6, atol=0)
        for key, weight in whole["weights"].items():
            torch.testing.assert_close(sharded["weights"][key], weight, **tolerance(precision))
    foreach, fused = fsdp2[world][f"{precision}/foreach"], fsdp2[world][f"{precision}/fused"]
    for key, weight in foreach["weights"].items():
        torch.testing.assert_close(fused["weights"][key], weight, **tolerance(precision))


# ---------------------------------------------------------------------- PPO (manual optimization)


def ppo_update(tmp_path: Path, fused: bool) -> dict[str, torch.Tensor]:
    from lightning.pytorch import Trainer, seed_everything

    import recipes.ppo as ppo
    from lightning_mem.data import PromptDataModule
    from lightning_mem.rl.config import GRPOConfig, PPOConfig
    from lightning_mem.rl.rollout import GenerationConfig
    from recipes.rewards import ArithmeticReward
    from tests.helpers import ARITH, TINY_MODEL

    seed_everything(0)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-3, fused=fused, foreach=not fused)  # noqa: E731
    module = ppo.PPOModule(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), generation=GenerationConfig(max_new_tokens=4),
        advantage_estimator="grpo", grpo=GRPOConfig(group_size=2), optimizer=adamw, export_dir=None,
        ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_tokens_per_microbatch=256, max_grad_norm=1e-4),
    )
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=2, max_prompt_length=64)
    trainer = Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_epochs=1, limit_train_batches=1,
                      default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return {k: v.detach().float().clone() for k, v in module.actor.named_parameters()}


def test_ppo_clips_with_fused_adamw_under_bf16_like_foreach(tmp_path):
    foreach, fused = ppo_update(tmp_path / "foreach", False), ppo_update(tmp_path / "fused", True)
    for name, weight in foreach.items():
        torch.testing.assert_close(fused[name], weight, rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- a 2D mesh (TP x DP)


def test_gradient_norm_over_tensor_and_data_parallel_counts_every_split_dimension(tmp_path):
    """FSDP2 over a tensor-parallel column split places dimension 0 as ``_StridedShard``: the norm
    must sum over that mesh dimension too (it once did not: the PPO TP2 x DP2 run clipped by a norm
    0.82 of the true one, and its gradients came out 1.2 times the DP2 run's)."""
    out = tmp_path / "norms.pt"
    port = _free_port()
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    procs = [
        subprocess.Popen([sys.executable, str(Path(__file__).with_name("clipping_mesh_worker.py")), str(out)],
                         env={**inherited, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                              "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(4)
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, f"worker failed:\n{output[-6000:]}"
    result = torch.load(out)
    assert any("_StridedShard" in p or "_S(" in p for p in result["placements"]), result["placements"]
    for p in ("1.0", "2.0", "inf"):
        got, want = result[p]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=lambda m: f"p={p}: {m}")
