"""The generator processes of separate placement: each its own copy of the actor, sampling ahead of training.

``model.async_rollout.generator_devices`` generators share the training ranks of a rollout group
(:mod:`lightning_mem.rl.rollout_link`): generator ``g`` serves training rank ``r`` when
``r % generators == g`` (:func:`served_by`). Each training rank sends its requests (iteration
``r``'s prompts) ahead of time to its generator, and rank 0 sends the weights to every generator
after every ``weight_sync_steps`` iterations, tagged with their version. The generator starts request ``r`` only
while the weights it holds are at most ``max_staleness`` versions older than ``r`` (admission
control: nothing is sampled to be thrown away), samples it with the engine
``model.rollout_engine.name`` names (:func:`generator_model`), and sends the batch back tagged with
the version it was sampled under, with the behaviour log-probs: the sampled tokens' log-probs under
the weights that sampled them. The ``hf`` engine's copy (:class:`GeneratorModel`) scores them in
the micro-batches of the trainer's own no-grad passes
(``model.ppo.logprob_max_tokens_per_microbatch``); vLLM (:class:`VLLMGeneratorModel`) returns its
own, and holds the process's only copy of the weights. When a request asks for it (ReMax's
baseline), the same engine then decodes one greedy answer per row under the same weights
(:func:`greedy_answers`), and they go back in the same batch.

Weights are only loaded between batches. With ``hf`` every batch prefills its own KV cache; vLLM's
prefix cache is emptied at every weight load. No token of a new version reads KV written under an
old one.
"""

from __future__ import annotations

import collections
import datetime
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from lightning_mem.rl import rollout_link as rl

if TYPE_CHECKING:
    from lightning_mem.rl.rollout import Experience


@dataclass
class GeneratorSpec:
    """Everything a generator process needs (picklable: it crosses a spawn)."""

    host: str
    port: int
    world_size: int  # training ranks + generators; the generators are the last ranks
    timeout_s: float
    max_staleness: int
    name_or_path: str
    dtype: str
    generation: Any  # GenerationConfig
    eos_token_ids: list[int]
    pad_token_id: int
    logits_chunk_size: int | str | None = 512  # rows per chunk, "auto" or None (lightning_mem.logits)
    # The behaviour log-prob pass's micro-batch budget: the trainer's no-grad passes' own
    # (``model.ppo.logprob_budget``; None: the whole batch at once), in real tokens when ``packing``.
    logprob_max_tokens: int | None = None
    packing: bool = False  # ``model.ppo.packing``: each micro-batch one padding-free row
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    rng_state: torch.Tensor | None = None
    num_threads: int | None = None
    # Seconds slept before each batch: tests make the generator slower than the trainer with it.
    delay_s: float = 0.0
    # A file the generator appends ``iteration version`` to for every batch it samples (tests
    # compare it with the versions the trainer recorded).
    trace_path: str | None = None
    generators: int = 1  # generator processes (``model.async_rollout.generator_devices``)
    index: int = 0  # this generator's place among them (set for each process at its start)
    # Where each generator holds its copy and samples, by index ("cuda:6"); None: the CPU.
    devices: list[str] | None = None
    # ``model.rollout_engine`` (a RolloutEngineConfig): its ``name`` picks the engine; None: ``hf``.
    engine: Any = None
    # ``model.environment`` (a factory) and ``model.multi_turn``: the generator runs the trajectories.
    environment: Any = None
    multi_turn: Any = None

    @property
    def engine_name(self) -> str:
        """The engine the generators run: ``model.rollout_engine.name`` (``hf`` when none is given)."""
        return "hf" if self.engine is None else self.engine.name

    @property
    def trainers(self) -> int:
        return self.world_size - self.generators

    @property
    def rank(self) -> int:
        """This generator's rank in the rollout group (after every training rank)."""
        return self.trainers + self.index

    @property
    def device(self) -> str:
        return self.devices[self.index] if self.devices else "cpu"


def served_by(trainer_rank: int, generators: int) -> int:
    """The generator (its index) that samples training rank ``trainer_rank``'s requests."""
    return trainer_rank % generators


def links_of(index: int, trainers: int, generators: int) -> list[int]:
    """The training ranks generator ``index`` talks to: those it serves, and rank 0, which sends
    every generator its weights."""
    return [r for r in range(trainers) if r == 0 or served_by(r, generators) == index]


def run_generator(spec: GeneratorSpec) -> None:
    """The process's entry point: serve until every training rank says stop (or the link fails)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.rng_state is not None:
        torch.set_rng_state(spec.rng_state)
    rank = spec.rank
    startup = max(spec.timeout_s, rl.STARTUP_S)
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=startup))
    group = rl.open_group(store, rank, spec.world_size, startup)
    generator = Generator(spec, group)
    for link in generator.links.values():  # loaded: the trainers may send weights now
        link.send(rl.READY, 0, 0, [], tag=rl.SAMPLES, what="saying it is ready")
    generator.serve()
    # NOTE: a normal interpreter exit tears the gloo group down under its own threads and aborts
    # (SIGABRT); every trainer has said stop, nothing is left to flush but our streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class GeneratorModel:
    """A generator's copy of the actor and what it does with it, without the link: :meth:`sample` a
    request, :meth:`load` one message of weights. The memory estimate runs these same two on fake
    tensors (:mod:`lightning_mem.estimate.generator`), with its own micro-batch ``plan`` (a
    :class:`~lightning_mem.step_io.StepIO`'s ``micro_batches``; default the library's)."""

    def __init__(self, spec: GeneratorSpec, model: torch.nn.Module | None = None, *,
                 plan: Callable[..., list[list[int]]] | None = None) -> None:
        from lightning_mem.models import load_causal_lm
        from lightning_mem.packed_attention import use_packed_sdpa
        from lightning_mem.rl.microbatch import micro_batches
        from lightning_mem.rl.reference import disable_dropout
        from lightning_mem.rl.rollout import RolloutEngine

        self.spec = spec
        self.plan = plan or micro_batches
        if model is None:  # its own copy, loaded from the checkpoint (the trainer's weights follow)
            model = disable_dropout(load_causal_lm(
                spec.name_or_path, dtype=spec.dtype, attn_implementation=spec.attn_implementation,
                trust_remote_code=spec.trust_remote_code, key="model.name_or_path"))
            if spec.packing:  # as the trainer's actor: sdpa scores each packed sequence alone
                use_packed_sdpa(model)
            if spec.device != "cpu":
                model.to(spec.device)
            model.eval()
        self.model = model
        self.engine = RolloutEngine(spec.generation, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id)
        self.trajectories = trajectory_rollout(spec, self.engine)
        self.tensors = dict(self.model.named_parameters())
        self.tensors.update(self.model.named_buffers())

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, *,
               greedy: bool = False, rows: list[dict[str, Any]] | None = None) -> list[torch.Tensor]:
        """One request's samples: ``input_ids, attention_mask, prompt_lengths, response_ids,
        response_mask`` and the behaviour log-probs (the sampled tokens scored with the same weights);
        with ``greedy``, then one greedy answer per row (:func:`greedy_answers`), same weights. With
        ``rows`` (an environment's run), one trajectory per row instead, and its extras after them."""
        if rows is not None:
            exp = self.trajectories.rollout(self.model, rows)
            return _trajectory_batch(exp, self.behaviour_logprobs(exp))
        device = self.spec.device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        exp = self.engine.generate(self.model, prompt_ids, prompt_mask, group_size=group_size)
        behaviour = self.behaviour_logprobs(exp)
        out = [exp.input_ids, exp.attention_mask, exp.prompt_lengths, exp.response_ids, exp.response_mask, behaviour]
        out = [t.cpu() for t in out]  # what the link sends (gloo: host tensors); off the device before the greedy decode
        del exp, behaviour
        if greedy:
            out += [t.cpu() for t in greedy_answers(self.engine, self.model, prompt_ids, prompt_mask)]
        return out

    @torch.no_grad()
    def behaviour_logprobs(self, exp: Experience) -> torch.Tensor:
        """``[N, R]`` fp32 log-probs of ``exp``'s sampled tokens under the weights that sampled them,
        micro-batch by micro-batch as the trainer's score phase runs its no-grad passes (same budget,
        same packing): the generator's peak follows ``model.ppo.logprob_max_tokens_per_microbatch``."""
        from lightning_mem.rl import rollout
        from lightning_mem.rl.microbatch import PackedBudget

        spec = self.spec
        budget = spec.logprob_max_tokens
        if spec.packing and budget is not None:
            budget = PackedBudget(budget)
        out = torch.zeros(exp.response_ids.shape, dtype=torch.float32, device=exp.response_ids.device)
        for idx in self.plan(exp.sequence_lengths, budget):
            mb = exp.select(idx)
            scored = rollout.policy_forward(self.model, mb, temperature=spec.generation.temperature,
                                            chunk_size=spec.logits_chunk_size, packed=spec.packing)
            out[idx, : mb.response_ids.shape[1]] = scored.logprobs.float()
            del mb, scored  # before the next micro-batch's forward
        return out

    @torch.no_grad()
    def load(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """One weights message's tensors, by name, copied into the model."""
        for name, tensor in zip(names, tensors):
            if name not in self.tensors:
                raise rl.LinkLost(f"async rollout: the generator's actor has no weight named {name!r}")
            self.tensors[name].copy_(tensor)

    def load_weights(self, messages: Iterable[tuple[list[str], list[torch.Tensor]]]) -> None:
        """One version's messages (names, tensors), each copied in and dropped before the next."""
        for names, tensors in messages:
            self.load(names, tensors)
            del names, tensors


class VLLMGeneratorModel:
    """A generator whose copy of the actor is vLLM's (``model.rollout_engine.name: vllm``): the
    process's only copy of the weights, in vLLM. :meth:`load_weights` streams a version's messages
    into it in place, in one reload (:meth:`~lightning_mem.rl.vllm_engine.VLLMRolloutEngine.load_weights`,
    which then empties the prefix cache); :meth:`sample` returns vLLM's own log-probs of the tokens
    it sampled (after temperature, as the trainer computes its own) as the behaviour log-probs.

    vLLM's prefix cache is on here: a GRPO group's copies of a prompt prefill once."""

    def __init__(self, spec: GeneratorSpec, engine: Any = None) -> None:
        from lightning_mem.dtypes import resolve_dtype
        from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

        self.spec = spec
        if engine is None:  # (the memory estimate passes its stand-in for vLLM)
            _only_visible_device(spec.device)
            engine = VLLMRolloutEngine(
                spec.generation, spec.engine, model_path=spec.name_or_path, eos_token_ids=spec.eos_token_ids,
                pad_token_id=spec.pad_token_id, dtype=resolve_dtype(spec.dtype),
                trust_remote_code=spec.trust_remote_code, prefix_caching=True)
            engine.start()  # config only, dummy weights: the trainer's first sync brings the real ones
        self.engine = engine
        self.trajectories = trajectory_rollout(spec, engine)

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, *,
               greedy: bool = False, rows: list[dict[str, Any]] | None = None) -> list[torch.Tensor]:
        """As :meth:`GeneratorModel.sample`, the behaviour log-probs vLLM's own (greedy: temperature 0)."""
        if rows is not None:
            exp = self.trajectories.rollout(None, rows)
            behaviour = exp.engine_logprobs if exp.engine_logprobs is not None else torch.zeros(exp.response_ids.shape)
            return _trajectory_batch(exp, behaviour.float())
        exp = self.engine.generate(None, prompt_ids, prompt_mask, group_size=group_size)
        out = [exp.input_ids, exp.attention_mask, exp.prompt_lengths, exp.response_ids, exp.response_mask,
               exp.engine_logprobs.float()]
        if greedy:
            out += greedy_answers(self.engine, None, prompt_ids, prompt_mask)
        return [t.cpu() for t in out]

    def load_weights(self, messages: Iterable[tuple[list[str], list[torch.Tensor]]]) -> None:
        def pairs() -> Iterator[tuple[str, torch.Tensor]]:
            for names, tensors in messages:
                yield from zip(names, tensors)
                del names, tensors  # copied in: dropped before the next message is received

        self.engine.load_weights(pairs())


def greedy_answers(engine: Any, model: torch.nn.Module | None, prompt_ids: torch.Tensor,
                   prompt_mask: torch.Tensor) -> list[torch.Tensor]:
    """ReMax's baseline as the link sends it: one greedy answer per row (response ids, lengths) by the
    engine that sampled the request, same weights (:func:`~lightning_mem.rl.rollout.greedy_rollout`)."""
    from lightning_mem.rl.rollout import greedy_rollout

    exp = greedy_rollout(engine, model, prompt_ids, prompt_mask)
    return [exp.response_ids, exp.response_lengths]


def trajectory_rollout(spec: GeneratorSpec, engine: Any) -> Any:
    """With an environment, the multi-turn rollout the generator runs with ``engine``; else None."""
    if spec.environment is None:
        return None
    from lightning_mem.models import load_tokenizer
    from lightning_mem.rl.multi_turn import multi_turn_rollout

    tokenizer = load_tokenizer(spec.name_or_path, trust_remote_code=spec.trust_remote_code, key="model.name_or_path")
    return multi_turn_rollout(spec.environment, spec.multi_turn, tokenizer=tokenizer, generation=spec.generation,
                              engine=engine, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id)


def _trajectory_batch(exp: Experience, behaviour: torch.Tensor) -> list[torch.Tensor]:
    """A multi-turn batch as the link sends it: the samples' six tensors, then the trajectories'
    scores, masks, counts and texts as one (:func:`~lightning_mem.rl.multi_turn.trajectory_extras`)."""
    from lightning_mem.rl.multi_turn import trajectory_extras

    out = [exp.input_ids, exp.attention_mask, exp.prompt_lengths, exp.response_ids, exp.response_mask, behaviour]
    return [t.cpu() for t in out] + [rl.json_tensor(trajectory_extras(exp))]


def generator_model(spec: GeneratorSpec, *, plan: Callable[..., list[list[int]]] | None = None) -> Any:
    """The generator's copy of the actor, for the engine ``spec.engine`` names (``model.rollout_engine.name``)."""
    if spec.engine_name == "vllm":
        return VLLMGeneratorModel(spec)
    return GeneratorModel(spec, plan=plan)


def _only_visible_device(device: str) -> None:
    """vLLM takes its process's first visible GPU: make the generator's device the only one visible
    (in the spawned process, before anything starts CUDA). NOTE: not run on a GPU yet."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]


class Generator:
    def __init__(self, spec: GeneratorSpec, group: dist.ProcessGroup) -> None:
        self.spec = spec
        trainers = links_of(spec.index, spec.trainers, spec.generators)
        self.links = {r: rl.Link(group, r, spec.timeout_s, lambda r=r: f"async rollout: generator {spec.index}'s link to training rank {r}")
                      for r in trainers}
        self.copy = generator_model(spec)
        self.version: int | None = None  # none until the first weights arrive
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.pending: dict[int, collections.deque] = {r: collections.deque() for r in trainers}
        self.stopped: set[int] = set()
        self.failure: str | None = None

    # -- threads: one receiver per training rank, one sender --------------------------------
    def _receive(self, rank: int) -> None:
        link = self.links[rank]
        try:
            while True:
                # As long as the trainer lives: a training step may outlast the timeout, and a
                # trainer that dies closes the connection (the generator then ends at once).
                kind, a, b, tensors = link.recv(tag=rl.CONTROL, what="waiting for the trainer's next message",
                                                timeout_s=rl.IDLE_S)
                self.inbox.put((kind, rank, a, b, tensors))
                if kind == rl.STOP:
                    return
        except rl.LinkLost as err:
            self.inbox.put((None, rank, 0, 0, str(err)))

    def _send(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            rank, r, version, tensors = item
            try:
                self.links[rank].send(rl.SAMPLE_BATCH, r, version, tensors, tag=rl.SAMPLES, what=f"sending batch {r}")
            except rl.LinkLost as err:
                self.failure = str(err)
                return

    # -- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        receivers = [threading.Thread(target=self._receive, args=(r,), daemon=True) for r in self.links]
        sender = threading.Thread(target=self._send, daemon=True)
        for t in (*receivers, sender):
            t.start()
        try:
            while len(self.stopped) < len(self.links) and self.failure is None:
                nxt = self._admissible()
                try:  # block only when nothing may start now (the receivers bound the wait)
                    self._handle(self.inbox.get(block=nxt is None))
                    continue
                except queue.Empty:
                    self._sample(*nxt)
        finally:
            # Batches sampled ahead of the run's end may never be received: the sender is not
            # waited for once every trainer said stop (a daemon thread, it ends with the process).
            self.outbox.put(None)
            if len(self.stopped) < len(self.links):
                sender.join(timeout=self.spec.timeout_s)
        if self.failure is not None:
            raise rl.LinkLost(self.failure)

    def _handle(self, item: tuple) -> None:
        kind, rank, a, b, payload = item
        if kind is None:
            raise rl.LinkLost(payload)
        if kind == rl.STOP:
            self.stopped.add(rank)
            self.pending[rank].clear()  # requests made ahead of a run's end are drained unsampled
        elif kind == rl.WEIGHT_UPDATE:
            self._load_weights(rank, a)
        elif kind == rl.REQUEST:
            queue_ = self.pending[rank]  # by iteration: a request made again (late policy `wait`) goes first
            at = next((i for i, (r, _, _) in enumerate(queue_) if r > a), len(queue_))
            queue_.insert(at, (a, b, payload))

    def _admissible(self) -> tuple[int, tuple] | None:
        """The oldest request (by iteration, then rank) whose samples would be at most ``k`` stale."""
        heads = [(q[0][0], rank) for rank, q in self.pending.items() if q]
        if not heads or self.version is None:
            return None
        r, rank = min(heads)
        if r - self.version > self.spec.max_staleness:
            return None
        return rank, self.pending[rank][0]

    def _sample(self, rank: int, request: tuple) -> None:
        self.pending[rank].popleft()
        r, number, payload = request
        group_size, greedy = rl.read_request_number(number)
        prompt_ids, prompt_mask = payload[0], payload[1]
        multi_turn = self.spec.environment is not None  # the prompts' data rows come next
        rows = rl.json_of(payload[2]) if multi_turn else None
        lockstep = len(payload) > 2 + multi_turn  # the trainer's random state: sample exactly as it would have
        if lockstep:
            torch.set_rng_state(payload[-1])
        if self.spec.delay_s:
            time.sleep(self.spec.delay_s)
        out = self.copy.sample(prompt_ids, prompt_mask, group_size, greedy=greedy, rows=rows)
        if self.spec.trace_path:
            with open(self.spec.trace_path, "a") as f:
                f.write(f"{r} {self.version}\n")
        if lockstep:
            out.append(torch.get_rng_state())
        self.outbox.put((rank, r, self.version, out))

    @torch.no_grad()
    def _load_weights(self, rank: int, version: int) -> None:
        """Receive version ``version`` message by message into the copy (between batches only)."""
        link = self.links[rank]
        what = f"receiving weights of version {version}"

        def messages() -> Iterator[tuple[list[str], list[torch.Tensor]]]:
            while True:
                kind, _, last, tensors = link.recv(tag=rl.WEIGHTS, what=what)
                if last:  # the end: no tensors
                    return
                yield rl.names_of(tensors[0]), tensors[1:]
                del tensors  # before the next message's buffers: one message's worth alive, not two

        stream = messages()
        self.copy.load_weights(stream)
        if next(stream, None) is not None:  # the link's next message would be read out of turn
            raise rl.LinkLost(f"async rollout: generator {self.spec.index} stopped taking version {version}'s weights early")
        self.version = version
