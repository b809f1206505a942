"""vLLM as the rollout engine, in the training process (``model.rollout_engine.name: vllm``).

vLLM is imported only when this engine starts: the rest of the project never needs it. It runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weight sync hands it the actor's tensors
directly, through a generator, with no serialisation and no file: ``reload_weights`` loads
them in place while :func:`~lightning_mem.rl.weight_sync.weight_buckets` converts at most
``sync_bucket_mb`` of them at a time.

The engine starts with dummy weights (``load_format="dummy"``: it reads the model's config only)
and gets the actor's real weights from the first sync, which the memory plan does before the first
rollout. So nothing is read from disk twice, and a LoRA actor's engine holds the merged weights.

Residency (:class:`~lightning_mem.rl.memory_plan.PhaseMemory` drives it): asleep outside the rollout
(``sleep_level`` 1 or 2), and woken in the order that keeps the peak lowest: weights first, then the
weight sync, then the KV cache. vLLM's CPU build has no sleep mode: there the engine stays awake,
and says so once.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.dtypes import resolve_dtype
from lightning_mem.padding import pad_sequences
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.weight_sync import checkpoint_weights, weight_buckets
from lightning_mem.rl.rollout import Experience, GenerationConfig, RolloutEngine, experience_from_generation

log = logging.getLogger(__name__)

CPU_SLEEP_WARNING = "vLLM engine: sleep mode does not exist on CPU; sleep_level={level} is a no-op here (the engine stays awake)"


@contextmanager
def _trainer_threads_kept() -> Iterator[None]:
    """Start vLLM without changing how the trainer, which shares this process, uses the CPU.

    vLLM's CPU worker is written for a process of its own: it cuts torch to one intra-op thread
    "for serving" and replaces ``torch.set_num_threads`` with a no-op that warns (so that nothing
    undoes its OpenMP binding). In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) no binding is
    made: the OpenMP thread binding belongs to its multiprocess executor, and the process's CPU
    affinity is left alone (measured: the same cores before and after start, 2026-11-23). So the
    trainer's thread count, ``torch.set_num_threads`` itself and the CPU affinity are put back
    as they were; vLLM calls ``set_num_threads`` only while it starts (model load, warm-up).
    """
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            set_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)


def _forget_stale_vllm_groups() -> None:
    """Drop vLLM's record of process groups that no longer exist.

    An engine that was never closed (a fit that ended in an exception: Lightning calls no
    ``on_fit_end`` then) leaves vLLM's module-level world group behind after its torch process group
    is gone; the next engine in the process would reuse the record and fail ("Process group ... is
    not initialized in the world group map"). A trainer's own group is never touched: this runs
    only when no torch group exists at all.
    """
    from vllm.distributed import parallel_state

    if torch.distributed.is_initialized() or getattr(parallel_state, "_WORLD", None) is None:
        return
    # Their torch groups are gone, so vLLM's destroy functions would fail on them: forget the records
    # (every module-level GroupCoordinator: world, tensor, pipeline, data... groups).
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)


class VLLMRolloutEngine(RolloutEngine):
    """Sample with a colocated ``vllm.LLM`` whose weights follow the actor's.

    Args:
        config: the generation knobs (shared with the Hugging Face engine).
        engine: the vLLM knobs (``model.rollout_engine``).
        model_path: the actor's checkpoint folder or hub id: vLLM reads its config (architecture,
            sizes) from there; the weights come from the actor.
        eos_token_ids, pad_token_id: as for :class:`RolloutEngine`.
        dtype: the engine's weight dtype when ``engine.dtype`` is None (the recipe passes the
            compute dtype of its precision).
        prefix_caching: vLLM's prefix cache (a prompt's KV blocks shared by the requests that start
            with it: a GRPO group's copies of a prompt prefill once). Off in the training process,
            where every rollout's prompts are new; the generator of separate placement turns it on.
            Every weight load empties it (:meth:`load_weights`), so no KV computed under old weights
            serves a new version's tokens.
    """

    name = "vllm"
    needs_weight_sync = True

    def __init__(
        self,
        config: GenerationConfig,
        engine: RolloutEngineConfig,
        *,
        model_path: str,
        eos_token_ids: list[int],
        pad_token_id: int,
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
        prefix_caching: bool = False,
    ) -> None:
        super().__init__(config, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        engine.validate(config)
        self.engine_config = engine
        self.model_path = model_path
        self.dtype = resolve_dtype(engine.dtype) or dtype
        self.trust_remote_code = trust_remote_code
        self.prefix_caching = prefix_caching
        self.weight_loads = 0  # weight loads so far, each followed by a prefix-cache reset
        self.llm: Any = None
        self.sleeping: int = 0  # the level the engine sleeps at now; 0 awake
        self.synced_bytes = 0  # bytes handed over by the last weight sync
        self.largest_bucket_bytes = 0  # the largest bucket of that sync
        self._cpu_warned = False
        self._owns_group = False

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def on_cuda(self) -> bool:
        return torch.cuda.is_available()

    @property
    def supports_sleep(self) -> bool:
        return self.on_cuda

    def start(self) -> None:
        """Start vLLM (config only, dummy weights); the first :meth:`sync_weights` loads the actor's."""
        if self.llm is not None:
            return
        # In this process: the weight iterator is handed over as an object, not pickled to a worker.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        cfg = self.engine_config
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            load_format="dummy",
            skip_tokenizer_init=True,  # prompts go in as token ids, responses come out as ids
            dtype=self.dtype,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_prefix_caching=self.prefix_caching,  # emptied at every weight load (load_weights)
            logprobs_mode="processed_logprobs",  # after temperature, like the trainer's logprobs
            # vLLM's defaults, not the folder's generation_config.json: the rollout samples only what
            # `generation` says (rl/sampling.py). Our stop tokens already hold the folder's eos ids.
            generation_config="vllm",
            trust_remote_code=self.trust_remote_code,
            seed=cfg.seed if cfg.seed is not None else 0,
        )
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.tensor_parallel_size > 1:  # vLLM's worker processes, one per GPU (validated: CUDA only)
            kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
        if self.on_cuda:
            kwargs["enable_sleep_mode"] = cfg.sleep_level > 0
        else:
            # On CPU gpu_memory_utilization would reserve that fraction of host memory: size the
            # KV cache explicitly instead.
            kwargs["kv_cache_memory_bytes"] = cfg.cpu_kv_cache_space_gb << 30
        self._say_ignored_settings()
        _forget_stale_vllm_groups()
        made_group = not torch.distributed.is_initialized()
        with _trainer_threads_kept():
            self.llm = LLM(**kwargs)
        # vLLM made this process's (single-process) group: close() destroys it, with vLLM's record of it.
        self._owns_group = made_group and torch.distributed.is_initialized()
        self.sleeping = 0

    def _say_ignored_settings(self) -> None:
        from transformers import GenerationConfig as HFGenerationConfig

        from lightning_mem.rl.sampling import hf_generation_config, say_ignored

        try:
            folder = HFGenerationConfig.from_pretrained(self.model_path)
        except OSError:  # no generation_config.json: nothing to leave out
            return
        say_ignored([folder], hf_generation_config(self.config, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id))

    def close(self) -> None:
        """Shut the engine down (end of fit): its weights and KV cache are freed, and the
        single-process group vLLM made in this process is destroyed."""
        if self.llm is not None:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            self.llm = None
            if core is not None:
                core.shutdown()
            gc.collect()
            if self._owns_group:
                from vllm.distributed import parallel_state

                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
                self._owns_group = False
        self.sleeping = 0

    @property
    def state(self) -> str:
        if self.llm is None:
            return "stopped"
        if self.sleeping:
            return f"asleep(level {self.sleeping})"
        return "awake"

    def sleep(self, level: int | None = None) -> None:
        """Free what ``level`` frees (1: KV cache discarded, weights to host; 2: both discarded).
        A no-op on CPU, with one warning."""
        level = self.engine_config.sleep_level if level is None else level
        if self.llm is None or level == 0 or self.sleeping:
            return
        if not self.supports_sleep:
            if not self._cpu_warned:
                log.warning(CPU_SLEEP_WARNING.format(level=level))
                self._cpu_warned = True
            return
        self.llm.sleep(level=level)
        self.sleeping = level

    def wake(self, tags: list[str]) -> None:
        """Bring back the ``tags`` (``"weights"``, ``"kv_cache"``); waking the KV cache also resumes
        scheduling, so the engine is fully awake after it."""
        if self.llm is None or not self.sleeping:
            return
        if "kv_cache" in tags:
            tags = [*tags, "scheduling"]
        self.llm.wake_up(tags=tags)
        if "kv_cache" in tags:
            self.sleeping = 0

    @property
    def weights_lost_in_sleep(self) -> bool:
        """Level 2 discards the weights: a sync must follow every wake."""
        return self.sleeping == 2

    @torch.no_grad()
    def sync_weights(self, actor: nn.Module) -> int:
        """Load the actor's current weights (merged, for a LoRA actor) into the engine, in place.
        Returns the bytes handed over."""
        if self.llm is None:
            self.start()
        bucket_bytes = self.engine_config.sync_bucket_mb << 20
        device = "cuda" if self.on_cuda else "cpu"
        total, largest = 0, 0

        def stream():
            nonlocal total, largest
            for bucket in weight_buckets(checkpoint_weights(actor), max_bytes=bucket_bytes, dtype=self.dtype, device=device):
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                total += size
                largest = max(largest, size)
                yield from bucket
                bucket.clear()  # the engine has copied them: drop this bucket before building the next

        if self.engine_config.tensor_parallel_size > 1:
            # vLLM's tensor-parallel workers are other processes: an iterator cannot cross to them,
            # so each bucket goes as a list of host tensors, one call per bucket.
            # NOTE: not run in this project's CI (no GPU); see docs/parallelism.md.
            for bucket in weight_buckets(checkpoint_weights(actor), max_bytes=bucket_bytes, dtype=self.dtype, device="cpu"):
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                total, largest = total + size, max(largest, size)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(bucket), "is_checkpoint_format": True})
            self._reset_prefix_cache()
        else:
            self.load_weights(stream())
        self.synced_bytes, self.largest_bucket_bytes = total, largest
        return total

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load ``(checkpoint name, tensor)`` pairs into the engine's weights in place, in one pass
        (vLLM's reload finishes a fused layer only when all of its parts arrived, so one version's
        tensors go in one call, streamed: each is copied in and may be dropped before the next is
        made), then empty the prefix cache: KV computed under the old weights serves no new token."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        # Between batches no request holds a block, so the reset cannot be refused; if it were,
        # sampling on would read KV of the old weights: stop instead.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM engine: its prefix cache could not be emptied after a weight load (requests"
                               " still hold KV blocks); sampling on would read KV computed under the old weights")
        self.weight_loads += 1

    # -- sampling ----------------------------------------------------------------------------
    def _sampling_params(self, n: int) -> list[Any]:
        from vllm import SamplingParams

        cfg = self.config
        common = dict(
            max_tokens=cfg.max_new_tokens,
            # Explicit, so that no default (vLLM's, or a folder's) can change the distribution.
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, min_tokens=0,
            stop_token_ids=self.eos_token_ids,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=False,
            skip_special_tokens=False,
        )
        if not cfg.do_sample:
            return [SamplingParams(temperature=0.0, **common)] * n
        # One seed per request, drawn from torch's generator: a seeded run samples the same responses.
        seeds = torch.randint(0, 2**31 - 1, (n,)).tolist()
        return [
            SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or -1, seed=s, **common)
            for s in seeds
        ]

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *, synced: bool = False,
                 group_size: int = 1) -> Experience:
        """Sample one response per row of the left-padded ``prompt_ids`` with vLLM (``model`` is the
        actor: its weights must have been synced; it is not run). ``exp.engine_logprobs`` holds the
        engine's logprob of each sampled token (a diagnostic; PPO's come from the actor)."""
        if synced:
            raise ValueError("the vLLM rollout engine runs in one process: use `trainer.devices: 1` with it")
        if self.llm is None:
            self.start()
            self.sync_weights(model)
        if self.sleeping:
            raise RuntimeError(f"vLLM engine is {self.state}: wake it (the memory plan's rollout phase does) before generating")
        from vllm.inputs import TokensPrompt

        lengths = prompt_mask.sum(dim=1).tolist()
        width = prompt_ids.shape[1]
        prompts = [TokensPrompt(prompt_token_ids=row[width - n :].tolist()) for row, n in zip(prompt_ids, lengths)]
        outputs = self.llm.generate(prompts, self._sampling_params(len(prompts)), use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        tokens = [list(c.token_ids) for c in completions]
        max_new = max([len(ids) for ids in tokens] + [1])
        responses, _ = pad_sequences(tokens, self.pad_token_id, length=max_new, dtype=prompt_ids.dtype)
        sampled = [[entry[t].logprob for t, entry in zip(ids, c.logprobs or [])] for ids, c in zip(tokens, completions)]
        logprobs, _ = pad_sequences(sampled, 0, length=max_new, dtype=torch.float32)
        device = prompt_ids.device
        sequences = torch.cat([prompt_ids, responses.to(device)], dim=1)
        exp = experience_from_generation(
            prompt_ids, prompt_mask, sequences, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id
        )
        exp.engine_logprobs = logprobs[:, : exp.response_ids.shape[1]].to(device) * exp.response_mask
        return exp
