"""Rollouts: sample responses with the actor, and hold the experience PPO learns from.

Generation runs on left-padded prompts (so that every prompt ends in the same column and the
model continues all of them in lockstep, with the KV cache on). The experience is then stored
*right-padded*, prompt and response back to back with no padding in between: the training and
logprob passes pack those sequences by token budget and need no position-id bookkeeping, and
per-token quantities (logprobs, values, advantages) are kept *response-aligned*, ``[N, R]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt
from torch import Tensor

from lightning_mem.padding import pad_sequences
from lightning_mem.rl.sampling import checkpoint_settings_hidden, hf_generation_config
from lightning_mem.settings import LeftOpenUnitInterval, SettingError, check_fields



@dataclass
class GenerationConfig:
    """How the actor samples responses (in the PPO recipe: ``model.generation``).

    Args:
        max_new_tokens: response length cap; a response that reaches it without an end-of-sequence
            token is kept (truncated) and scored as it is.
        temperature: sampling temperature; the PPO logprobs are taken at the same temperature, so
            the ratio pi/pi_old compares the distributions that were actually sampled from.
        top_p: must be 1.0 (the full distribution). PPO's log-probs score the plain temperature
            softmax, so a nucleus cut would sample another distribution than the one scored; the
            key stays so that configs naming 1.0 keep working (docs/ppo.md, "What the rollout samples").
        top_k: must be 0 (no cut), for the same reason.
        do_sample: False is greedy decoding (evaluation only: PPO needs samples).
        kv_cache: ``"dynamic"``: Hugging Face ``generate``, its cache grown per call (freed when
            generation returns). ``"static"``: the static decode loop
            (:class:`~lightning_mem.rl.decode.StaticDecoder`): one cache preallocated for
            ``prompt_bucket``-rounded prompts + ``max_new_tokens``, reused between rollouts unless
            the memory plan frees it (``free_kv_cache``), a fixed-shape decode step and one host
            sync per ``check_every`` tokens.
        compile: ``torch.compile`` the static loop's decode step (``mode="reduce-overhead"``: CUDA
            graphs on a GPU); compiled once per run and shape. Needs ``kv_cache: static``.
        prompt_bucket: the static loop pads prompts to a multiple of this many columns, so that
            rollouts whose longest prompt differs a little share one cache and one compiled step.
        check_every: the static loop asks whether every response has ended once per this many
            tokens (each ask is a host sync; the tokens after an end are padding either way).
        merge_lora: a LoRA actor samples with its adapters merged into the base weights (one matmul
            per layer instead of three); the base weights are put back bit for bit afterwards.
    """

    max_new_tokens: PositiveInt = 32
    temperature: PositiveFloat = 1.0
    top_p: LeftOpenUnitInterval = 1.0
    top_k: NonNegativeInt = 0
    do_sample: bool = True
    kv_cache: Literal["dynamic", "static"] = "dynamic"
    compile: bool = False
    prompt_bucket: PositiveInt = 64
    check_every: PositiveInt = 16
    merge_lora: bool = True

    def __post_init__(self) -> None:
        # Every rule is a typed constraint: the CLI checks them while parsing, this in Python.
        check_fields(self)
        if self.compile and self.kv_cache != "static":
            raise SettingError("compile", "`compile: true` compiles the static decode loop's step: set"
                               " `kv_cache: static` too", siblings=("kv_cache",))
        # Refused rather than modelled: a cut's kept set moves with the weights, so the update's
        # log-probs would renormalise over another set than the rollout's (and -inf outside it).
        why = ": the log-prob pass scores the full softmax at `temperature`, so a cut would sample another distribution"
        if self.top_p != 1.0:
            raise SettingError("top_p", f" must be 1.0, got {self.top_p!r}{why}", siblings=("temperature",))
        if self.top_k != 0:
            raise SettingError("top_k", f" must be 0, got {self.top_k!r}{why}", siblings=("temperature",))


@dataclass
class Experience:
    """One rollout batch: ``N`` samples (prompt + response), then everything PPO computes on them.

    Sequence tensors (``input_ids``, ``attention_mask``) are ``[N, T]``, right-padded. Response
    tensors (``response_ids``, ``response_mask`` and every per-token quantity) are ``[N, R]``,
    response-aligned: column j is the j-th token after the prompt.

    ``response_mask`` marks the policy's actions, the tokens it sampled. In a single-turn rollout
    they are a prefix of each row; in a multi-turn one (:mod:`lightning_mem.rl.trajectory`) the
    observation tokens between two turns are real tokens of the sequence (``attention_mask`` 1)
    that the mask leaves out: it has holes, and nothing here assumes it is a prefix.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_lengths: Tensor  # [N]
    response_ids: Tensor
    response_mask: Tensor
    group_ids: Tensor  # [N]: index of the prompt in this batch (GRPO groups by it)
    rows: list[dict[str, Any]] = field(default_factory=list)  # the prompt's data row, per sample
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    baseline_responses: list[str] = field(default_factory=list)  # ReMax: the greedy answer to each sample's prompt
    # Filled by the scoring phase.
    scores: Tensor | None = None  # [N]
    baseline_scores: Tensor | None = None  # [N] ReMax: the greedy answer's score
    old_logprobs: Tensor | None = None  # [N, R]
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    engine_logprobs: Tensor | None = None  # [N, R] the rollout engine's own, when it has its own weights (a diagnostic)
    teacher_logprobs: Tensor | None = None  # [N, R] a distillation teacher's (model.teacher; rl/distillation.py)
    teacher_topk_logprobs: Tensor | None = None  # [N, R, k] fp32 the teacher's k likeliest tokens' (teacher.top_k)
    teacher_topk_ids: Tensor | None = None  # [N, R, k] int32 their token ids
    versions: Tensor | None = None  # [N] the weight version each sample was drawn under (separate placement)
    sample_keep: Tensor | None = None  # [N] bool, the rollout's own verdict: False keeps a sample out of the loss
    # Filled by the advantage phase.
    advantages: Tensor | None = None
    returns: Tensor | None = None
    kl: Tensor | None = None  # [N] each sample's summed KL to the reference (the rollout's policy)
    loss_mask: Tensor | None = None  # [N, R] the response tokens that train (filters drop samples)
    correction_weights: Tensor | None = None  # [N, R] the rollout correction's weight per token
    sample_stats: dict[str, Tensor] = field(default_factory=dict)  # sums for the step's metrics
    # Each sample's (sequence length, response span, sampled tokens) on the host, read back once
    # (see sequence_lengths). The span runs to the last sampled token; with no holes it is their count.
    host_lengths: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def sequence_lengths(self) -> list[int]:
        """Each sample's real tokens, on the host. The first call reads them back from the device
        (with the response lengths: one read for both); :meth:`select` of a list of indices -- a
        micro-batch of the plan made from these -- then trims without reading the device again."""
        if self.host_lengths is None:
            three = torch.stack([self.attention_mask.sum(dim=1).long(), response_spans(self.response_mask),
                                 self.response_mask.sum(dim=1).long()])
            sequences, spans, counts = three.tolist()
            self.host_lengths = (sequences, spans, counts)
        return self.host_lengths[0]

    @property
    def response_lengths(self) -> Tensor:
        """The sampled tokens of each sample (a multi-turn trajectory's observations not counted)."""
        return self.response_mask.sum(dim=1)

    @property
    def contiguous_lengths(self) -> list[int] | None:
        """Each response's length on the host when every mask is a prefix of its row (the fast path
        of :func:`~lightning_mem.logits.response_targets`); None where a mask has holes or the
        lengths were not read back."""
        if self.host_lengths is None or self.host_lengths[1] != self.host_lengths[2]:
            return None
        return self.host_lengths[2]

    def select(self, indices: list[int] | Tensor) -> Experience:
        """The samples at ``indices``, with columns trimmed to the longest selected sequence and response
        (a micro-batch of short samples then costs only its own length)."""
        device = self.input_ids.device
        lengths = None
        if isinstance(indices, Tensor) and self.host_lengths is not None:
            indices = indices.tolist()  # one read-back (a mini-batch's order), where the lengths took two
        if isinstance(indices, Tensor) or self.host_lengths is None:
            idx = torch.as_tensor(indices, dtype=torch.long, device=device)
            seq_len = int(self.attention_mask[idx].sum(dim=1).max())
            resp_len = max(int(response_spans(self.response_mask[idx]).max()), 1)
            picked = idx.tolist()
        else:  # host indices and host lengths: nothing is read back from the device
            picked = list(indices)
            lengths = tuple([part[i] for i in picked] for part in self.host_lengths)
            seq_len, resp_len = max(lengths[0]), max(max(lengths[1]), 1)
            idx = torch.as_tensor(picked, dtype=torch.long)
            # From pinned memory the copy is queued behind the step's work instead of waiting for it.
            idx = idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx.to(device)
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value[idx]
                if value.dim() >= 2:  # [N, T], or [N, R, ...] response-aligned
                    value = value[:, : seq_len if f.name in ("input_ids", "attention_mask") else resp_len]
            elif isinstance(value, list) and value:
                value = [value[i] for i in picked]
            out[f.name] = value
        out["host_lengths"] = lengths
        return replace(self, **out)


def response_spans(response_mask: Tensor) -> Tensor:
    """``[N]``: each row's columns up to and including its last masked-in token (0 for an empty
    row). A prefix mask's span is its count; a multi-turn mask's covers its observations too."""
    if response_mask.shape[1] == 0:
        return torch.zeros(response_mask.shape[0], dtype=torch.long, device=response_mask.device)
    columns = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return (response_mask.bool().long() * columns).amax(dim=1)


# ---------------------------------------------------------------------------------------------
# Building experience from generated tokens
# ---------------------------------------------------------------------------------------------


def response_mask_until_eos(responses: Tensor, eos_token_ids: list[int]) -> Tensor:
    """1 on each response token up to and including the first end-of-sequence token, 0 after.

    The end token itself is a choice the policy made (to stop), so it is trained and scored like
    any other token; what comes after it is padding that ``generate`` filled in.
    """
    is_end = torch.zeros_like(responses, dtype=torch.bool)
    for eos in eos_token_ids:
        is_end |= responses == eos
    # Tokens strictly after the first end token: the running count of ends before them is > 0.
    ends_before = torch.cumsum(is_end.long(), dim=1) - is_end.long()
    return (ends_before == 0).long()


def experience_from_generation(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sequences: Tensor,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
) -> Experience:
    """Re-lay ``generate``'s output (left-padded prompt + response) as right-padded experience."""
    width = prompt_ids.shape[1]
    responses = sequences[:, width:]
    response_mask = response_mask_until_eos(responses, eos_token_ids)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    prompt_lengths = prompt_mask.sum(dim=1)
    response_lengths = response_mask.sum(dim=1)
    n = sequences.shape[0]
    rows = [torch.cat([prompt_ids[i, width - int(p) :], responses[i, : int(r)]])
            for i, (p, r) in enumerate(zip(prompt_lengths.tolist(), response_lengths.tolist()))]
    input_ids, attention_mask = pad_sequences(rows, pad_token_id, dtype=sequences.dtype, device=sequences.device)
    return Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lengths=prompt_lengths,
        response_ids=responses,
        response_mask=response_mask,
        group_ids=torch.arange(n, device=sequences.device),
    )


def response_positions(prompt_lengths: Tensor, response_length: int) -> Tensor:
    """``[N, R]`` positions whose outputs predict each response token: prompt_length - 1 + j.

    A causal LM's output at position t predicts token t + 1, so the logits (and the critic's value)
    for response token j of a sample with prompt length P sit at position P - 1 + j.
    """
    offsets = torch.arange(response_length, device=prompt_lengths.device)
    return prompt_lengths.unsqueeze(1) - 1 + offsets.unsqueeze(0)


def gather_response(per_position: Tensor, prompt_lengths: Tensor, response_length: int, *, offset: int = 0) -> Tensor:
    """Pick each response token's row out of ``per_position`` (``[N, L, ...]``, position ``offset``
    at index 0); positions past the end (padding) are clamped and must be masked by the caller."""
    index = (response_positions(prompt_lengths, response_length) - offset).clamp(0, per_position.shape[1] - 1)
    if per_position.dim() == 3:
        index = index.unsqueeze(-1).expand(-1, -1, per_position.shape[-1])
    return per_position.gather(1, index)


# ---------------------------------------------------------------------------------------------
# Forward passes on experience: logprobs (actor, reference) and values (critic)
# ---------------------------------------------------------------------------------------------


@dataclass
class PolicyOutput:
    logprobs: Tensor  # [n, R]
    entropy: Tensor | None  # [n, R], when asked for
    hidden: Tensor | None  # [n, R, H] final hidden states at response positions (shared critic)
    extra: Tensor | None = None  # [n, R, ...] what ``policy_forward``'s ``extra`` computed per token


def policy_forward(
    model: torch.nn.Module,
    batch: Experience,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_hidden: bool = False,
    chunk_size: int | None = 512,
    packed: bool = False,
    extra: Callable[[ResponseTokens], Callable[[Tensor, torch.nn.Module], Tensor]] | None = None,
) -> PolicyOutput:
    """Logprobs of ``batch``'s response tokens under ``model`` (and optionally their entropy;
    ``entropy_grad=False`` computes it outside the autograd graph, as a metric only).

    Only the response tokens' positions reach the output layer, ``chunk_size`` at a time
    (:func:`lightning_mem.logits.score_tokens`): no ``[tokens, vocab]`` tensor beyond one chunk is
    alive, and backward recomputes a chunk's logits. ``with_hidden`` returns the final hidden states
    at the same positions (a shared value head reads them), without asking the model for every
    layer's output.

    ``packed`` runs the batch's sequences as one padding-free row
    (:func:`lightning_mem.data.packing.pack_right_padded`); the results come back ``[n, R]`` as
    they do padded. ``extra(tokens)`` (given the batch's :class:`ResponseTokens`) makes
    ``score_tokens``' ``extra``, computed inside the forward on the scored rows (a distillation
    teacher's divergence, :meth:`~lightning_mem.rl.distillation.OnPolicyDistillation.in_forward`).
    """
    from lightning_mem.logits import score_tokens

    tokens = response_tokens(batch, packed=packed)
    scores = score_tokens(model, tokens.input_ids, tokens.attention_mask, tokens.positions, tokens.targets,
                          position_ids=tokens.position_ids, chunk_size=chunk_size, temperature=temperature,
                          with_entropy=with_entropy, entropy_grad=entropy_grad, with_hidden=with_hidden,
                          extra=None if extra is None else extra(tokens))
    return PolicyOutput(tokens.aligned(scores.logprobs), tokens.aligned(scores.entropy), tokens.aligned(scores.hidden),
                        tokens.aligned(scores.extra))


@dataclass
class ResponseTokens:
    """What a forward over a batch's response tokens reads (:func:`response_tokens`): the model's
    inputs, the flat ``positions`` whose outputs predict the ``targets``, and where each lands in
    the response-aligned ``[n, R]`` layout."""

    input_ids: Tensor
    attention_mask: Tensor | None  # None when packed (the position ids separate the sequences)
    position_ids: Tensor | None
    positions: Tensor
    targets: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]  # [n, R]

    def aligned(self, values: Tensor | None) -> Tensor | None:
        """``[k, ...]`` values per target back to ``[n, R, ...]``; padding positions hold 0 (the caller masks them)."""
        if values is None:
            return None
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)


def response_tokens(batch: Experience, *, packed: bool = False) -> ResponseTokens:
    """The positions and targets of ``batch``'s response tokens, as the actor's, reference's and a
    teacher's passes score them: right-padded rows, or (``packed``) the batch's sequences as one
    padding-free row (:func:`lightning_mem.data.packing.pack_right_padded`)."""
    from lightning_mem.data.packing import pack_right_padded
    from lightning_mem.logits import response_targets

    lengths = batch.contiguous_lengths  # known and without holes: no device search
    if packed:
        row = pack_right_padded(batch.input_ids, batch.attention_mask)
        positions, targets, (rows, cols) = response_targets(
            batch.prompt_lengths, batch.response_ids, batch.response_mask, 0, starts=row.starts,
            response_lengths=lengths,
        )
        inputs = (row.input_ids, None, row.position_ids)
    else:
        positions, targets, (rows, cols) = response_targets(
            batch.prompt_lengths, batch.response_ids, batch.response_mask, batch.input_ids.shape[1],
            response_lengths=lengths,
        )
        inputs = (batch.input_ids, batch.attention_mask, None)
    return ResponseTokens(*inputs, positions, targets, rows, cols, tuple(batch.response_ids.shape))


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


class RolloutEngine:
    """Sample responses from a causal LM with ``generate`` and turn them into :class:`Experience`.

    This is the default rollout engine and the interface every engine has
    (:mod:`lightning_mem.rl.engines`; vLLM's is :class:`~lightning_mem.rl.vllm_engine.VLLMRolloutEngine`).
    The memory plan drives an engine's residency with ``start``/``sleep``/``wake``/``sync_weights``:
    this one generates with the actor itself, so it has no weights of its own to sync or park; its
    sleep frees the static KV cache (:meth:`free_kv_cache`), which it owns when ``kv_cache: static``
    (preallocated once, reused by every rollout).
    """

    name = "hf"
    #: True for an engine with its own copy of the weights: the plan syncs them after each update.
    needs_weight_sync = False
    supports_sleep = True
    weights_lost_in_sleep = False

    def __init__(self, config: GenerationConfig, *, eos_token_ids: list[int], pad_token_id: int) -> None:
        from lightning_mem.rl.decode import StaticDecoder

        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.decoder = StaticDecoder(prompt_bucket=config.prompt_bucket, compile=config.compile,
                                     check_every=config.check_every)
        self._fallback_said = False

    @property
    def kv_cache(self) -> Any:
        """The static loop's preallocated cache, while it holds one."""
        return self.decoder.cache

    # The engine interface. Nothing to start, and no weights to sync: generate runs the actor.
    def start(self) -> None:
        pass

    def close(self) -> None:
        self.free_kv_cache()

    @property
    def state(self) -> str:
        return "awake" if self.kv_cache is not None else "no KV cache held"

    def sleep(self, level: int | None = None) -> None:
        """Between rollouts: free the static KV cache (the actor's weights are training's)."""
        self.free_kv_cache()

    def wake(self, tags: list[str]) -> None:
        pass

    def sync_weights(self, actor: torch.nn.Module) -> int:
        return 0

    def free_kv_cache(self) -> bool:
        """Drop the preallocated cache (True if there was one); the next rollout allocates anew."""
        return self.decoder.free()

    def _static_loop_runs(self, model: torch.nn.Module) -> bool:
        from lightning_mem.rl.decode import supports_static_decode

        if self.config.kv_cache != "static":
            return False
        why_not = supports_static_decode(model)
        if why_not is not None and not self._fallback_said:
            warnings.warn(f"`generation.kv_cache: static`: {why_not}; sampling with Hugging Face `generate` instead",
                          stacklevel=2)
            self._fallback_said = True
        return why_not is None

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *, synced: bool = False,
                 group_size: int = 1) -> Experience:
        """Sample one response per row of the left-padded ``prompt_ids``.

        ``synced=True`` keeps every rank running forward passes until all ranks are done: with a
        sharded model each forward is a collective, and a rank that stopped early would hang the
        others. ``group_size`` > 1: the rows are runs of that many copies of a prompt (GRPO), which
        the static loop prefills once each.
        """
        from lightning_mem.lora import merged_adapters

        cfg = self.config
        was_training = model.training
        model.eval()  # no dropout while sampling: the logprob pass must see the same distribution
        try:
            # Neither path takes a sampling setting from the checkpoint; the run says once which it leaves out.
            settings = hf_generation_config(cfg, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)
            with merged_adapters(model, enabled=cfg.merge_lora), checkpoint_settings_hidden(model, settings):
                if self._static_loop_runs(model):
                    sequences = self.decoder.generate(
                        model, prompt_ids, prompt_mask, max_new_tokens=cfg.max_new_tokens,
                        eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                        temperature=cfg.temperature, do_sample=cfg.do_sample,
                        synced=synced, group_size=group_size,
                    )
                else:
                    sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=synced,
                                               generation_config=settings)
        finally:
            model.train(was_training)
        return experience_from_generation(
            prompt_ids, prompt_mask, sequences, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id
        )


def greedy_rollout(engine: Any, model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *,
                   synced: bool = False) -> Experience:
    """One greedy answer per row of ``prompt_ids`` from ``engine`` (ReMax's baseline, Li et al. 2023):
    the engine's own ``generate`` with ``do_sample`` off for this call only. Every engine reads its
    :class:`GenerationConfig` at each call (``generate`` here, vLLM's sampling parameters), so the
    same engine, its KV cache and its memory plan serve both rollouts of the step."""
    sampling = engine.config
    engine.config = replace(sampling, do_sample=False)
    try:
        return engine.generate(model, prompt_ids, prompt_mask, synced=synced)
    finally:
        engine.config = sampling
