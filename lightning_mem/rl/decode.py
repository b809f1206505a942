"""The static decode loop: sampling on the actor itself from a preallocated KV cache, one compilable step.

Hugging Face ``generate`` is general, and a rollout pays for it: the KV cache grows by
concatenation every step (a copy of the whole cache per token), the checkpoint's own sampling
settings are merged into each call, every step builds its masks and logits processors in Python
and asks the device whether all rows are done (a host sync per token). At a 0.5B model and a few
hundred rows the decode step is overhead-bound, tens of milliseconds against a memory-bound floor
of one or two (docs/ppo.md, "Speed on a GPU").

:class:`StaticDecoder` does what a rollout needs and nothing else:

- **One cache per run.** A ``transformers.StaticCache`` for ``[batch, bucket(prompt) + max_new_tokens]``
  is made once and reused by every rollout of the same shape (``reset`` between them). Prompts are
  left-padded to a multiple of ``prompt_bucket`` columns, so rollouts whose longest prompt differs
  a little share one shape, one cache and one compiled step.
- **One decode step, compilable.** The step takes the last tokens, their positions and the
  attention mask, all of fixed shapes, and returns the last position's logits. With ``compile``
  it goes through ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs on a GPU), which
  compiles it once per shape. The prefill runs eager (its width changes with the prompts).
- **The tempered softmax, nothing else.** Tokens are drawn from ``softmax(logits / temperature)``
  (greedy when not sampling), exactly the distribution the PPO log-prob pass computes; no
  repetition penalty, no n-gram ban, no cut, nothing from the checkpoint. Sampling is the
  exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws from ``p`` without a host sync
  and without sorting the vocabulary.
- **One host sync per ``check_every`` tokens**, to stop when every row has ended (under
  ``synced`` the ranks agree on it with one all-reduce, so sharded forwards stay in lockstep).

- **Grouped-query attention without copies.** With a mask, transformers' ``sdpa`` attention
  repeats each key/value head for every query head of its group (``repeat_kv``) before calling
  SDPA: at Qwen2.5-0.5B's 14 query heads over 2 key/value heads, each decode step writes and reads
  the whole KV cache seven times over, tens of GB per step at a rollout's batch. The decode step
  runs :func:`grouped_decode_attention` instead, which puts a group's query heads on SDPA's query
  axis (one query token: they share the mask) and reads each key/value head once. (transformers
  5.24 does the same, but not under ``torch.compile``; 5.17 never.)

The attention mask is the decoder's own ``[batch, 1, 1, cache]`` tensor (prompt padding off,
columns not yet written off), passed as a prepared 4D mask so the model builds none. That needs an
attention whose mask is a tensor: ``sdpa`` (boolean) or ``eager`` (additive); other
implementations keep ``generate`` (:func:`supports_static_decode`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

#: Attention implementations whose mask the decoder can hand over as a prepared 4D tensor.
MASKED_ATTENTION = ("sdpa", "eager")

# Set while the memory estimate runs a recipe on fake tensors: the token every draw yields.
_ESTIMATED = contextvars.ContextVar("lightning_mem_static_decode_estimated", default=None)


@contextlib.contextmanager
def estimated_decode(fill_token: int) -> Iterator[None]:
    """Inside: the loop runs as the memory estimate needs it (:mod:`lightning_mem.estimate`). Its
    tensors are fake, so every draw is ``fill_token`` (the sampling's transients still happen), the
    step runs eager (nothing compiles fake tensors), and it stops after the first decode step: with
    a preallocated cache every decode step has the same shapes, so the first stands for the last.
    The rest of each response is ``fill_token`` (or padding after an end token), as the whole loop
    would write."""
    token = _ESTIMATED.set(int(fill_token))
    try:
        yield
    finally:
        _ESTIMATED.reset(token)


#: The attention the decode step runs under (registered with transformers on first use).
DECODE_ATTENTION = "lightning_mem_grouped_decode"


def grouped_decode_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention for one query token per row over a KV cache, reading each key/value head once.

    ``query`` is ``[B, Hq, 1, D]``, ``key``/``value`` ``[B, Hkv, L, D]`` with ``Hq = G * Hkv`` (query
    head ``h`` reads key/value head ``h // G``, as ``repeat_kv`` lays them out). Viewed as
    ``[B, Hkv, G, D]``, the G query heads of a group become G query rows of one SDPA call against
    their key/value head; with one token they share the mask (``[B, 1, 1, L]``, boolean or additive),
    and no causal mask applies among them. Anything else goes to transformers' own ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1)
    if q_len != 1 or heads == kv_heads or not shared_mask or kwargs.get("s_aux") is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


@functools.cache
def _register_decode_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)


@contextlib.contextmanager
def decode_attention(model: nn.Module) -> Iterator[None]:
    """Inside: ``model`` attends with :func:`grouped_decode_attention` (its config names it)."""
    _register_decode_attention()
    config = _text_model(model).config
    before = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def _text_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft's wrappers (its forward's signature names the cache)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def cache_argument(model: nn.Module) -> str:
    """The name a model's forward takes its KV cache by: ``past_key_values`` up to transformers 5.17,
    ``cache`` in later 5.x (which still accepts the old name, with a deprecation warning)."""
    params = inspect.signature(type(_text_model(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def supports_static_decode(model: nn.Module) -> str | None:
    """None if :class:`StaticDecoder` can run ``model``, else why not (in words)."""
    config = getattr(_text_model(model), "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn not in MASKED_ATTENTION:
        return f"attention {attn!r} takes no prepared mask (the static decoder needs one of {list(MASKED_ATTENTION)})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        return "sliding-window attention (the static decoder's mask is a full causal one)"
    return None


def bucketed(width: int, bucket: int) -> int:
    """``width`` rounded up to a multiple of ``bucket``."""
    return -(-width // bucket) * bucket


def sample_tokens(logits: Tensor, *, temperature: float, do_sample: bool) -> Tensor:
    """One token per row of ``logits`` (``[B, V]``): greedy, or a draw from the tempered softmax
    (the distribution PPO's log-prob pass scores; no top-k or top-p cut, which
    :class:`~lightning_mem.rl.rollout.GenerationConfig` refuses). No host sync, no sort."""
    if not do_sample:
        return logits.argmax(dim=-1)
    # At most two [B, V] fp32 tensors at once (at a rollout's 512 rows and 152k tokens, 311 MB each).
    probs = logits.to(torch.float32, copy=True).div_(temperature).softmax(dim=-1)
    # The exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i.
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


class StaticDecoder:
    """Sample from a causal LM with a preallocated KV cache and a (compilable) fixed-shape decode step.

    Args:
        prompt_bucket: prompts are left-padded to a multiple of this many columns, so that rollouts
            with slightly different prompt widths share a cache and a compiled step.
        compile: run the decode step through ``torch.compile``.
        compile_mode: ``torch.compile``'s mode; ``"reduce-overhead"`` records CUDA graphs on a GPU
            (on a CPU it is Inductor without graphs).
        backend: ``torch.compile``'s backend (tests count compiles with a counting backend).
        check_every: decode steps between checks that every row has ended (each check is one host
            sync).
    """

    def __init__(self, *, prompt_bucket: int = 64, compile: bool = False, compile_mode: str | None = "reduce-overhead",
                 backend: str | Callable = "inductor", check_every: int = 16) -> None:
        self.prompt_bucket = prompt_bucket
        self.compile = compile
        self.compile_mode = compile_mode
        self.backend = backend
        self.check_every = check_every
        self.cache: Any = None
        self.shape: tuple[int, int] = (0, 0)  # (rows, cache length) the cache was made for
        self._mask: Tensor | None = None  # [rows, 1, 1, cache length], the decode step's attention mask
        self._step: Callable | None = None
        self._step_model: nn.Module | None = None

    # -- the cache ---------------------------------------------------------------------------------
    def free(self) -> bool:
        """Drop the cache (True if there was one); the next rollout allocates anew. The compiled
        step stays: the next cache has the same shapes (on a GPU its graphs are re-recorded)."""
        had = self.cache is not None
        self.cache = None
        self._mask = None
        self.shape = (0, 0)
        return had

    def _cache_for(self, model: nn.Module, rows: int, length: int) -> Any:
        from transformers import StaticCache

        if self.cache is not None and self.shape == (rows, length):
            self.cache.reset()
            return self.cache
        self.cache = None  # another shape: let the old one go before the new one is made
        self.cache = StaticCache(config=_text_model(model).config, max_cache_len=length)
        self.shape = (rows, length)
        return self.cache

    def _mask_buffer(self, prompt_mask: Tensor, length: int, dtype: torch.dtype, additive: bool) -> Tensor:
        """The decode step's 4D mask ``[rows, 1, 1, length]``: on for the prompts' real tokens, off for
        their padding and for the columns not yet written. One persistent tensor (its address stays
        put for CUDA graphs); each step switches one column on (:meth:`_open_column`)."""
        rows, width = prompt_mask.shape
        want, mask_dtype = (rows, 1, 1, length), (dtype if additive else torch.bool)
        mask = self._mask
        if mask is None or mask.shape != want or mask.dtype != mask_dtype or mask.device != prompt_mask.device:
            mask = self._mask = torch.empty(want, dtype=mask_dtype, device=prompt_mask.device)
        on, off = self._on_off(mask)
        flat = mask.view(rows, length)
        flat.fill_(off)
        flat[:, :width].masked_fill_(prompt_mask.bool(), on)
        return mask

    @staticmethod
    def _on_off(mask: Tensor) -> tuple[Any, Any]:
        if mask.dtype == torch.bool:
            return True, False
        return 0.0, torch.finfo(mask.dtype).min  # additive, as eager attention adds it to the scores

    def _open_column(self, column: int) -> None:
        on, _ = self._on_off(self._mask)
        self._mask[:, 0, 0, column] = on

    # -- the step ----------------------------------------------------------------------------------
    @staticmethod
    def _eager_step(model: nn.Module) -> Callable:
        cache_name = cache_argument(model)

        def step(input_ids: Tensor, position_ids: Tensor, mask: Tensor, cache: Any) -> Tensor:
            with decode_attention(model):
                out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                            use_cache=True, logits_to_keep=1, **{cache_name: cache})
            return out.logits[:, -1, :]

        return step

    def _decode_step(self, model: nn.Module) -> Callable:
        if self._step is not None and self._step_model is model:
            return self._step
        step = self._eager_step(model)
        if self.compile:
            # A mode is Inductor's; another backend (a test's counter) takes none.
            options = {"mode": self.compile_mode} if self.backend == "inductor" else {}
            step = torch.compile(step, backend=self.backend, dynamic=False, **options)
        self._step = step
        self._step_model = model
        return self._step

    # -- a rollout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int,
                 eos_token_ids: list[int], pad_token_id: int, temperature: float = 1.0, do_sample: bool = True,
                 synced: bool = False, group_size: int = 1) -> Tensor:
        """``[rows, width + max_new_tokens]``: the left-padded prompts, then each row's tokens (the
        end-of-sequence token included; ``pad_token_id`` after it), as ``generate`` returns them.

        ``group_size`` > 1 says the rows come in runs of that many copies of one prompt (GRPO's
        groups, ``repeat_interleave``): each prompt is prefilled once and its KV copied to its
        group's rows (:meth:`_shared_prefill`)."""
        rows, width = prompt_ids.shape
        device = prompt_ids.device
        padded = bucketed(width, self.prompt_bucket)
        length = padded + max_new_tokens
        extra = padded - width
        ids = torch.nn.functional.pad(prompt_ids, (extra, 0), value=pad_token_id)
        mask = torch.nn.functional.pad(prompt_mask, (extra, 0), value=0)
        cache = self._cache_for(model, rows, length)
        cache_name = cache_argument(model)
        attn = _text_model(model).config._attn_implementation

        # Prefill, eager: the padded prompts fill columns [0, padded) of the cache.
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        if group_size > 1 and rows % group_size == 0:
            logits = self._shared_prefill(model, ids, mask, positions, cache, group_size)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1, **{cache_name: cache}).logits[:, -1, :]
        # Columns a decode step may attend to: the prompt's real tokens, then each written token.
        step_mask = self._mask_buffer(mask, length, logits.dtype, additive=(attn == "eager"))
        position = positions[:, -1:] + 1
        out = torch.full((rows, max_new_tokens), pad_token_id, dtype=prompt_ids.dtype, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.as_tensor(eos_token_ids, dtype=prompt_ids.dtype, device=device)
        fill = _ESTIMATED.get()
        step = self._decode_step(model) if fill is None else self._eager_step(model)
        for t in range(max_new_tokens):
            token = sample_tokens(logits, temperature=temperature, do_sample=do_sample)
            if fill is not None:  # the estimate: the draw's transients, then its stand-in token
                token = torch.full_like(token, fill)
                if t == 1 or fill in eos_token_ids:  # one decode step stands for all (or the responses end here)
                    out[:, t:] = pad_token_id if fill in eos_token_ids and t > 0 else fill
                    break
            out[:, t] = token.masked_fill(finished, pad_token_id)
            finished |= torch.isin(token, eos)
            if t + 1 == max_new_tokens or ((t + 1) % self.check_every == 0 and self._all_done(finished, synced)):
                break
            # The token just drawn goes into column padded + t; the step may attend to it now.
            self._open_column(padded + t)
            logits = step(token[:, None].to(prompt_ids.dtype), position, step_mask, cache)
            position = position + 1
        return torch.cat([prompt_ids, out], dim=1)

    @staticmethod
    def _shared_prefill(model: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, group: int) -> Tensor:
        """Prefill each group's prompt once, then copy its keys and values into the static cache's
        rows of that group (a broadcast copy, no repeated tensor). Its activations are those of
        ``rows / group`` prompts; the last position's logits are repeated for the group's draws."""
        from transformers import DynamicCache

        rows = ids.shape[0]
        first = slice(None, None, group)
        shared = DynamicCache(config=_text_model(model).config)
        logits = model(input_ids=ids[first], attention_mask=mask[first], position_ids=positions[first], use_cache=True,
                       logits_to_keep=1, **{cache_argument(model): shared}).logits[:, -1, :]
        width = ids.shape[1]
        for static, filled in zip(cache.layers, shared.layers):
            keys, values = filled.keys, filled.values  # [rows / group, heads, width, dim]
            if not static.is_initialized:  # sized for every row: it reads shapes, dtype and device only
                static.lazy_initialization(keys.new_empty((rows, *keys.shape[1:])), values.new_empty((rows, *values.shape[1:])))
            for target, source in ((static.keys, keys), (static.values, values)):
                view = target.view(rows // group, group, *target.shape[1:])[:, :, :, :width]
                view.copy_(source.unsqueeze(1).expand_as(view))
            static.cumulative_length.fill_(width)
            filled.keys = filled.values = None
        return logits.repeat_interleave(group, dim=0)

    @staticmethod
    def _all_done(finished: Tensor, synced: bool) -> bool:
        done = finished.all()
        if synced and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = done.to(torch.int32)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            done = flag.bool()
        return bool(done)
