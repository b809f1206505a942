"""Separate placement as the estimate sees it: a training rank that receives samples, and a
generating rank with a copy of the actor of its own.

A run with ``model.rollout_engine.placement: separate`` has two kinds of rank
(:mod:`lightning_mem.rl.async_client`): ``trainer.devices`` training ranks, which take the
generators' samples and then score, compute old/reference log-probs and values, and train, as the
colocated run does; and ``model.async_rollout.generator_devices`` generating ranks, each a process
with its own copy of the actor's weights in the compute dtype that samples one training rank's
prompt batch at a time and takes the weights in messages of the bucketed sync.

The estimate runs both with the code the run runs:

- **The training rank** is the recipe's own fit (:class:`~lightning_mem.estimate.run.EstimateRun`).
  Its :class:`~lightning_mem.step_io.StepIO` gives the recipe a :class:`GeneratorStandIn` for the
  rollout group's client: no process starts; a request's samples are made by the generator's own
  sampling (:meth:`~lightning_mem.rl.async_generator.GeneratorModel.sample`), run on the trainer's
  fake actor outside the measured peak (the training rank does not generate), so what is left is
  what the link would hand over: the samples, in the layout the generator sends.
- **The generating rank** (:func:`generating_rank`) runs after the fit, on a ledger of its own:
  the generator's :class:`~lightning_mem.rl.async_generator.GeneratorModel` is built from the
  config (weights in the compute dtype); phase ``load_weights`` receives every message of the
  weight sync (:func:`~lightning_mem.rl.async_client.weight_messages`) into buffers made as the
  link makes them (:func:`~lightning_mem.rl.rollout_link.receive_buffers`) and loads it; phase
  ``generate`` samples the measured step's request -- the prefill and last decode step of
  :func:`~lightning_mem.estimate.decode_peak.last_decode_step`, then the behaviour log-probs in the
  micro-batches of ``model.ppo.logprob_max_tokens_per_microbatch`` (the estimate's StepIO plan, as
  for the recipe's score phase), and under ReMax the greedy answers' decode beside the samples --
  while the ``max_staleness`` batches sampled ahead wait in its outbox.

  With ``model.rollout_engine.name: vllm`` the generator's copy is vLLM's, which cannot run on fake
  tensors: as in a colocated estimate (:mod:`lightning_mem.estimate.engine`) it is a reservation
  made at the generator's start and held for good (a generator never sleeps): its weights (the
  copy's tensors stand for them: same names, shapes and dtype) and the rest of
  ``gpu_memory_utilization`` of the device (on the CPU, ``cpu_kv_cache_space_gb``). ``load_weights``
  receives the same messages beside it; ``generate`` runs the generator's
  :class:`~lightning_mem.rl.async_generator.VLLMGeneratorModel` on the stand-in engine (vLLM's
  log-probs come with its samples: no pass of ours).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.estimate.decode_peak import last_decode_step
from lightning_mem.estimate.recorder import PhaseEstimate, attribution
from lightning_mem.estimate.tracker import CATEGORIES, MemoryLedger, TrackingMode
from lightning_mem.estimate.trajectories import at_budget, zero_extras

#: The training rank's phase that, in separate placement, only receives the generator's samples.
RECEIVE_PHASE = "receive"


@dataclass
class RoleEstimate:
    """One kind of rank of a run with two (separate placement's generating ranks): how many, and the
    peak of each of its phases on one of them."""

    role: str
    ranks: int
    phases: list[PhaseEstimate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def device_peak_bytes(self) -> int:
        return max(p.device_peak_bytes for p in self.phases)

    @property
    def host_peak_bytes(self) -> int:
        return max(p.host_peak_bytes for p in self.phases)


class GeneratorStandIn:
    """The estimate's :class:`~lightning_mem.rl.async_client.AsyncRolloutClient`: the same calls, no
    process. It keeps the generators' spec, the requests and the trainer's actor (from the first
    weight sync); :meth:`receive` hands back a request's samples, made by the generator's own code
    on that actor, unmeasured (see the module's docstring)."""

    def __init__(self, spec: Any, *, run: Any, rank: int = 0, world_size: int = 1, bucket_mb: int = 256,
                 sync_dtype: torch.dtype | None = None, **_: Any) -> None:
        self.spec, self.run = spec, run
        self.rank, self.world_size = rank, world_size
        self.bucket_bytes, self.sync_dtype = bucket_mb * 2**20, sync_dtype
        self.submitted = -1
        self.closed = False
        self.actor: nn.Module | None = None
        self.requests: deque = deque()
        #: The largest request (``prompt_ids, prompt_mask`` as lists, ``group_size``, whether it asks for
        #: greedy answers) and its samples' layout.
        self.largest: tuple[list, list, int, bool] | None = None
        self.sample_layout: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def start(self) -> None:
        pass

    def submit(self, iteration: int, prompt_ids: Tensor, prompt_mask: Tensor, *, group_size: int = 1,
               rng_state: Tensor | None = None, greedy_baseline: bool = False, rows: Any = None) -> None:
        # With an environment (``rows``), the generator's trajectories reach their token budget.
        _, prompt_ids, prompt_mask = at_budget(self.spec, prompt_ids, prompt_mask)
        self.requests.append((iteration, prompt_ids, prompt_mask, group_size, rng_state, greedy_baseline))
        self.submitted = max(self.submitted, iteration)

    def receive(self) -> tuple[int, int, list[Tensor]]:
        from lightning_mem.rl import rollout_link as rl
        from lightning_mem.rl.async_generator import GeneratorModel

        iteration, prompt_ids, prompt_mask, group_size, rng_state, greedy = self.requests.popleft()
        largest = self.largest is None or prompt_ids.numel() >= len(self.largest[0]) * len(self.largest[0][0])
        if largest:  # as numbers: a tensor kept here would stay alive in the training rank's ledger
            self.largest = (prompt_ids.tolist(), prompt_mask.tolist(), group_size, greedy)
        actor, ledger = self.actor, self.run.ledger
        was_training = actor.training
        with ledger.unmeasured(), self.run.generation(actor):
            try:
                spec = at_budget(self.spec, prompt_ids, prompt_mask)[0]
                samples = GeneratorModel(spec, model=actor, plan=self.run.micro_batches).sample(
                    prompt_ids, prompt_mask, group_size, greedy=greedy)
                if spec.environment is not None:  # the trajectories' scores and counts, as the link sends them
                    samples.append(rl.json_tensor(zero_extras(len(samples[0]), spec.environment().counters)))
            finally:
                actor.train(was_training)
        take_peak_now(ledger)  # the samples have arrived: they count from here
        if largest:
            self.sample_layout = rl.layout_of(samples)
        if rng_state is not None:  # lockstep: the generator sends back the random state it sampled with
            samples.append(rng_state)
        return iteration, iteration, samples

    def sync_weights(self, actor: nn.Module, version: int) -> int:
        # The training rank's side of the sync (one cast bucket, gathered whole under FSDP2) comes
        # after its train phase and is not estimated; the generating rank's side is.
        self.actor = actor
        return 0

    def close(self, *, kill: bool = False) -> None:
        self.closed = True


def take_peak_now(ledger: MemoryLedger) -> None:
    """Let the ledger's peak see its live bytes now (after an :meth:`~MemoryLedger.unmeasured` block
    that left tensors alive), without waiting for the next allocation."""
    if ledger.view is not None:
        ledger.observe()
    elif ledger.device_bytes > ledger.peak_bytes:
        ledger.peak_bytes = ledger.device_bytes
        ledger.peak_breakdown = {c: ledger.totals[c] for c in CATEGORIES}


def generating_rank(run: Any, stand_in: GeneratorStandIn, *, ranks: int, max_staleness: int) -> RoleEstimate:
    """One generating rank's phases: ``load_weights`` and ``generate`` (see the module's docstring)."""
    from lightning_mem.estimate.cuda import padded_attention_masks
    from lightning_mem.estimate.fake import weights_source
    from lightning_mem.rl import rollout_link as rl
    from lightning_mem.rl.async_generator import GeneratorModel

    spec = stand_in.spec
    vllm = spec.engine_name == "vllm"
    if stand_in.largest is None:
        raise RuntimeError("the estimate's fit asked the generator for no samples: nothing to estimate it from")
    ledger = MemoryLedger(set(run.ledger.vocab_sizes))
    ledger.round_bytes = run.ledger.round_bytes
    mode = TrackingMode(ledger, fake=run.fake, fixed_sampling=True, fill_token=run._fill)
    padded = padded_attention_masks() if run.device_model is not None and run.device_model.padded_batches \
        else contextlib.nullcontext()
    phases = []
    ids, mask, group_size, greedy = stand_in.largest
    spec = at_budget(spec, torch.tensor(ids), torch.tensor(mask))[0]  # (the request was cut to the budget)
    with attribution(ledger, run.fake), weights_source(run.fake), padded, mode:
        if run.device_model is not None and not vllm:  # one thread's cuBLAS workspaces: it runs no backward
            # (vLLM's profile counts its own inside `gpu_memory_utilization`)
            with ledger.section("other"):
                workspaces = torch.empty(type(run.device_model)(blas_threads=1).workspace_bytes, dtype=torch.uint8)
        copy = GeneratorModel(spec, plan=run.micro_batches)  # the StepIO's plan, as the recipe's passes
        for t in [*copy.model.parameters(), *copy.model.buffers()]:
            ledger.retag(t, "weights")
        # vLLM: the rest of its reservation, beside the weights the copy stands for.
        engine = _reserved_engine(run, ledger, mode, spec, copy.model) if vllm else None

        ledger.reset_peak()
        _receive_weights(copy, stand_in)
        phases.append(_phase("load_weights", ledger, f"{len(list(copy.model.parameters()))} tensors in messages of"
                                                     f" at most {stand_in.bucket_bytes >> 20} MiB"))

        # Batches sampled ahead wait in the outbox until their training rank takes them.
        outbox = [list(rl.receive_buffers(stand_in.sample_layout)) for _ in range(max_staleness)]
        prompt_ids, prompt_mask = torch.tensor(ids), torch.tensor(mask)  # the request, as the link received it
        ledger.reset_peak()
        samples = _sample(run, ledger, mode, copy, engine, prompt_ids, prompt_mask, group_size, greedy)
        rows, width = samples[0].shape
        phases.append(_phase("generate", ledger, f"{rows} x {width} tokens ({max_staleness} batch(es) in the outbox)"))
        del samples, outbox
        if run.device_model is not None and not vllm:
            del workspaces
    holder = "vLLM's copy of the actor and its reservation" if vllm else "its own copy of the actor"
    notes = [f"generating rank: {holder} in {spec.dtype}; samples one training rank's batch at a time (training"
             f" ranks r with r % {ranks} equal to its index)"]
    return RoleEstimate("generating", ranks, phases, notes)


def _receive_weights(copy: Any, stand_in: GeneratorStandIn) -> None:
    """Every message of the weight sync received into buffers made as the link makes them, and loaded."""
    from lightning_mem.rl import rollout_link as rl
    from lightning_mem.rl.async_client import weight_messages

    for names, tensors in weight_messages(copy.model, bucket_bytes=stand_in.bucket_bytes, dtype=stand_in.sync_dtype):
        # The message's layout (its names, then the tensors) as the header gives it; the tensors
        # here are the copy's own (the sync dtype is its dtype), so nothing is made but the receive
        # buffers.
        layout = [(torch.uint8, (len("\n".join(names).encode()),)), *((t.dtype, tuple(t.shape)) for t in tensors)]
        buffers = list(rl.receive_buffers(layout))
        for buffer, sent in zip(buffers[1:], tensors):
            buffer.copy_(sent)  # what the wire does
        copy.load(names, buffers[1:])
        del buffers, tensors, buffer, sent  # as the generator drops a message before the next


def _sample(run: Any, ledger: MemoryLedger, mode: TrackingMode, copy: Any, engine: Any, prompt_ids: Tensor,
            prompt_mask: Tensor, group_size: int, greedy: bool) -> list[Tensor]:
    """The request sampled as the generator samples it: by vLLM's stand-in ``engine`` if given, else
    by the copy, with the estimate's decode shortcut (prefill and last decode step); with ``greedy``
    (ReMax) its greedy answers too, by the same call."""
    from lightning_mem.rl.async_generator import VLLMGeneratorModel
    from lightning_mem.rl.decode import estimated_decode

    with contextlib.ExitStack() as stack:
        stack.enter_context(estimated_decode(mode.fill_token))
        if engine is not None:
            return VLLMGeneratorModel(copy.spec, engine=engine).sample(prompt_ids, prompt_mask, group_size, greedy=greedy)
        if not run.full_loops:
            stack.enter_context(last_decode_step(SimpleNamespace(ledger=ledger, mode=mode), copy.model))
        return copy.sample(prompt_ids, prompt_mask, group_size, greedy=greedy)


def _reserved_engine(run: Any, ledger: MemoryLedger, mode: TrackingMode, spec: Any, weights: nn.Module) -> Any:
    """vLLM's stand-in for a separate generator: started, with the rest of its reservation held."""
    from lightning_mem.dtypes import resolve_dtype
    from lightning_mem.estimate.engine import ReservedEngine

    engine = ReservedEngine(spec.generation, spec.engine, run=SimpleNamespace(ledger=ledger, mode=mode),
                            on_cuda=run.on_cuda, device_memory=run.device_memory, eos_token_ids=spec.eos_token_ids,
                            pad_token_id=spec.pad_token_id, dtype=resolve_dtype(spec.dtype))
    engine.reserve_beside(sum(t.numel() * t.element_size() for t in [*weights.parameters(), *weights.buffers()]))
    return engine


def _phase(name: str, ledger: MemoryLedger, shape: str) -> PhaseEstimate:
    breakdown = dict(ledger.peak_breakdown)
    return PhaseEstimate(name, sum(breakdown.values()), breakdown, ledger.peak_host_bytes, shape)
