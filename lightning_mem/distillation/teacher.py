"""The teacher: a frozen causal LM that a student learns from, with its own place in the memory plan.

One role for both kinds of distillation:

- **logit distillation** (the SFT recipe's ``model.distillation``): :meth:`Teacher.hidden_states`
  returns the teacher's final hidden states at the scored positions (``[n, hidden]``), and the loss
  applies :attr:`Teacher.output_layer` to them a vocabulary slice at a time
  (:mod:`lightning_mem.distillation.divergences`);
- **on-policy distillation**: :meth:`Teacher.logprobs` returns the log-prob of each given target
  token under the teacher (``[n]`` floats, through :func:`lightning_mem.logits.chunked_logprobs`,
  never ``[n, vocab]``).

The teacher is held outside the student's module tree: Lightning does not move it, a strategy does
not shard it (every rank holds its own copy: quantize it or park it to fit), and no checkpoint
carries it (it reloads from ``name_or_path``). Where it lives (``placement``):

- ``device``: on the student's device for the whole fit;
- ``host``: on the host between its uses, as PPO's memory plan parks frozen models
  (:mod:`lightning_mem.offload`): :meth:`Teacher.on_device` brings it in for its forward and parks
  it again. It never changes, so its host copy (pinned on CUDA) is made once and kept: parking
  drops the device tensors, and each forward costs one host-to-device copy (a 4-bit teacher, whose
  weights carry quantization state that moves with them, is copied back each time). For logit
  distillation its output layer (and an input embedding tied to it) stays on the device: the
  student's loss applies it in its forward and backward;
- a device of its own (``cuda:1``): there for the whole fit; what it computes comes back to the
  student's device (for logit distillation with a copy of its output layer there).

Frozen means ``requires_grad=False``, eval mode and no dropout, whatever the checkpoint says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.dtypes import resolve_dtype
from lightning_mem.logits import causal_lm_of, check_supported, chunked_logprobs, fusable, hidden_states_at
from lightning_mem.models import check_model_source, load_causal_lm
from lightning_mem.quantization import QuantizationSettings, freeze_quantized_base, load_quantized_causal_lm
from lightning_mem.rl.reference import disable_dropout
from lightning_mem.settings import SettingError, settings_at

PLACEMENTS = ("device", "host")


def placement_device(placement: str) -> torch.device | None:
    """The device a placement names (None for ``device`` and ``host``).

    Raises:
        SettingError: naming ``placement``, for anything but ``device``, ``host`` or a device name.
    """
    if placement in PLACEMENTS:
        return None
    try:
        return torch.device(placement)
    except (RuntimeError, TypeError):
        raise SettingError("placement", f" must be 'device', 'host' or a device such as 'cuda:1', got {placement!r}") from None


@dataclass
class TeacherSettings:
    """The teacher (in the SFT recipe, ``model.distillation.teacher``).

    Args:
        name_or_path: local model folder or hub id, on the student's tokenizer.
        dtype: the teacher's parameter dtype; None: the compute dtype of ``trainer.precision``
            (bf16 under ``bf16-mixed``, fp32 under ``32-true``). With ``quantization``, the dtype of
            what stays unquantized (embeddings, norms, output layer).
        quantization: load its linear layers in 4 (or 8) bits through bitsandbytes
            (:class:`~lightning_mem.quantization.QuantizationSettings`).
        placement: ``device``, ``host`` or a device of its own (module docstring).
        attn_implementation: None: the student's.
    """

    name_or_path: str
    dtype: str | None = None
    quantization: QuantizationSettings | None = None
    placement: str = "device"
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.quantization, dict):  # the CLI's hparams hold plain dicts
            self.quantization = QuantizationSettings(**self.quantization)
        resolve_dtype(self.dtype, key="dtype")
        placement_device(self.placement)
        check_model_source(self.name_or_path, key="name_or_path")


def _sliced(head: nn.Module, width: int) -> nn.Module:
    """``head`` cut to its first ``width`` rows: a plain ``nn.Linear`` over views of its weight
    (and bias), made at each use, since moving the teacher swaps its tensors. A layer that is not
    a plain linear one is returned whole (the divergences cut its output's columns instead)."""
    if head.weight.shape[0] == width or not fusable(head):
        return head
    view = nn.Linear(head.in_features, width, bias=head.bias is not None, device="meta")
    view.weight = nn.Parameter(head.weight[:width], requires_grad=False)
    if head.bias is not None:
        view.bias = nn.Parameter(head.bias[:width], requires_grad=False)
    return view


def _without(module: nn.Module, kept: set[int]) -> list[nn.Module]:
    """The largest submodules of ``module`` that hold none of the parameters in ``kept``."""
    if not any(id(p) in kept for p in module.parameters()):
        return [module]
    return [part for child in module.children() for part in _without(child, kept)]


class Teacher:
    """A frozen causal LM, loaded and placed by :meth:`load` (see the module docstring).

    Args:
        settings: what to load and where it lives.
        output_layer_with_student: logit distillation: the student's loss applies
            :attr:`output_layer` on the student's device (it stays there under ``host``, and is
            copied there from a device of its own). False (on-policy distillation): the whole
            teacher parks, and only :meth:`logprobs` uses its output layer.
        key: what errors call the teacher (``model.distillation.teacher``).
    """

    def __init__(self, settings: TeacherSettings, *, output_layer_with_student: bool = False,
                 key: str = "teacher") -> None:
        self.settings = settings
        self.output_layer_with_student = output_layer_with_student
        self.key = key
        self.model: nn.Module | None = None
        self.width: int | None = None
        self.student_device = torch.device("cpu")
        self.home = torch.device("cpu")  # where its forward runs
        self._parked: list[nn.Module] = []  # what lives on the host between uses
        self._host: dict[int, list[Tensor]] = {}  # their kept host tensors, by id of the part
        self._head_copy: nn.Linear | None = None

    # -- loading and placing ----------------------------------------------------------------------
    def load(self, *, student_device: torch.device, compute_dtype: torch.dtype, width: int,
             source: str | None = None, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> nn.Module:
        """Load the teacher frozen, check it can be scored, and place it.

        ``width``: the output rows compared (:func:`~lightning_mem.distillation.vocabulary.shared_vocabulary`).
        ``source``: where to read it if not ``name_or_path`` (a config-only folder's saved random
        weights, which a 4-bit load needs). ``compute_dtype``: its dtype when ``dtype`` is unset.
        """
        s = self.settings
        dtype = resolve_dtype(s.dtype, key="dtype") or compute_dtype
        attn = s.attn_implementation or attn_implementation
        with settings_at(self.key):
            if s.quantization is not None:
                model = load_quantized_causal_lm(source or s.name_or_path, s.quantization, attn_implementation=attn,
                                                 trust_remote_code=trust_remote_code)
                model = freeze_quantized_base(model, dtype)
            else:
                model = load_causal_lm(source or s.name_or_path, dtype=dtype, attn_implementation=attn,
                                       trust_remote_code=trust_remote_code, key="name_or_path")
            try:
                check_supported(model)
            except ValueError:  # its forward rescales or caps the logits after the output layer
                raise SettingError("name_or_path", f": {type(model).__name__} transforms its logits after its output"
                                   " layer, which distillation here does not reproduce; it cannot be a teacher") from None
        rows = causal_lm_of(model).get_output_embeddings().weight.shape[0]
        if rows < width:
            raise SettingError(f"{self.key}.name_or_path", f": its output layer has {rows} rows, fewer than the {width} compared")
        model.config.use_cache = False
        self.model = disable_dropout(model).requires_grad_(False).eval()
        self.width = width
        self._place(torch.device(student_device))
        return self.model

    def _place(self, student_device: torch.device) -> None:
        from lightning_mem import offload  # the module, not its functions: the memory estimate wraps them

        model, placement = self.model, self.settings.placement
        self.student_device = student_device
        own = placement_device(placement)
        self.home = own or student_device
        if placement != "host":
            # nn.Module's own move, as Lightning moves a QLoRA base: transformers' override refuses a
            # bitsandbytes model, whose weights (and their quantization state) move as any others.
            nn.Module.to(model, self.home)
            if own is not None and own != student_device and self.output_layer_with_student:
                head = _sliced(self._head(), self.width)
                self._head_copy = _copy_to(head, student_device)
            return
        head = self._head()
        kept = {id(p) for p in head.parameters()} if self.output_layer_with_student else set()
        self._parked = _without(model, kept)
        pin = student_device.type == "cuda"  # loaded on the host: pinned here, as offload pins what leaves a GPU
        quantized = self.settings.quantization is not None
        for part in self._parked:
            ledger = offload.offload_module(part)
            ledger.home = {name: student_device for name in ledger.home}
            if pin:
                for tensor in _tensors(part):
                    tensor.data = tensor.data.pin_memory()
            if not quantized:
                self._host[id(part)] = [t.data for t in _tensors(part)]
        if kept:  # the output layer (and an embedding tied to it) lives on the device
            for module in model.modules():
                if any(id(p) in kept for p in module.parameters(recurse=False)):
                    module.to(student_device)

    def _head(self) -> nn.Module:
        return causal_lm_of(self.model).get_output_embeddings()

    @property
    def output_layer(self) -> nn.Module:
        """The teacher's output layer cut to the compared width, on the student's device (logit
        distillation reads it in the student's loss)."""
        return self._head_copy if self._head_copy is not None else _sliced(self._head(), self.width)

    @property
    def location(self) -> str:
        """``host`` while the parked parts are on the host, else ``device``."""
        from lightning_mem.offload import module_location

        return "host" if any(module_location(part) == "host" for part in self._parked) else "device"

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The teacher where its forward runs for the block; parked on the host again after it."""
        from lightning_mem import offload

        for part in self._parked:
            offload.reload_module(part)  # copies to the device; the kept host tensors stay
        try:
            yield
        finally:
            for part in self._parked:
                self._park(part)

    def _park(self, part: nn.Module) -> None:
        from lightning_mem import offload

        kept = self._host.get(id(part))
        if kept is None:
            offload.offload_module(part)
            return
        for tensor, host in zip(_tensors(part), kept):
            tensor.data = host  # the device copy is dropped; the host one is still exact
        offload.module_residency(part).location = "host"

    # -- what it computes (call inside on_device) ----------------------------------------------
    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor, *,
                      position_ids: Tensor | None = None) -> Tensor:
        """``[n, hidden]`` final hidden states at ``positions`` (as :func:`lightning_mem.logits.score_tokens`
        takes them), without gradients, on the student's device."""
        with torch.no_grad():
            hidden = hidden_states_at(self.model, *_to(self.home, input_ids, attention_mask, positions),
                                      position_ids=_to(self.home, position_ids)[0])
        return hidden.to(self.student_device)

    def logprobs(self, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor, targets: Tensor, *,
                 chunk_size: int | str | None = "auto", temperature: float = 1.0,
                 position_ids: Tensor | None = None) -> Tensor:
        """``[n]`` fp32 log-probs of ``targets`` at ``positions`` under the teacher (at ``temperature``,
        over the compared width), on the student's device: what on-policy distillation needs."""
        with torch.no_grad():
            ids, mask, where, wanted = _to(self.home, input_ids, attention_mask, positions, targets)
            hidden = hidden_states_at(self.model, ids, mask, where, position_ids=_to(self.home, position_ids)[0])
            logprobs, _ = chunked_logprobs(hidden, wanted, _sliced(self._head(), self.width), chunk_size=chunk_size,
                                           temperature=temperature)
        return logprobs.to(self.student_device)

    def top_k(self, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor, targets: Tensor, *, k: int,
              chunk_size: int | str | None = "auto", temperature: float = 1.0,
              position_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`logprobs` and, at the same positions, the teacher's ``k`` most likely tokens:
        ``(target [n], top [n, k] fp32, ids [n, k] int32)`` on the student's device
        (:func:`lightning_mem.distillation.topk.teacher_top_k`: one chunk of logits at a time)."""
        from lightning_mem.distillation.topk import teacher_top_k

        with torch.no_grad():
            ids, mask, where, wanted = _to(self.home, input_ids, attention_mask, positions, targets)
            hidden = hidden_states_at(self.model, ids, mask, where, position_ids=_to(self.home, position_ids)[0])
            out = teacher_top_k(hidden, _sliced(self._head(), self.width), wanted, k=k, width=self.width,
                                temperature=temperature, chunk_size=chunk_size)
        return tuple(t.to(self.student_device) for t in out)


def _tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *(b for b in module.buffers() if b is not None)]


def _to(device: torch.device, *tensors: Tensor | None) -> list[Tensor | None]:
    return [None if t is None else t.to(device, non_blocking=True) for t in tensors]


def _copy_to(head: nn.Module, device: torch.device) -> nn.Linear:
    """A plain linear copy of an output layer on ``device``, for a teacher whose own lives elsewhere."""
    weight = head.weight.detach()
    copy = nn.Linear(weight.shape[1], weight.shape[0], bias=head.bias is not None, device="meta")
    copy.weight = nn.Parameter(weight.to(device, copy=True), requires_grad=False)
    if head.bias is not None:
        copy.bias = nn.Parameter(head.bias.detach().to(device, copy=True), requires_grad=False)
    return copy


def held_models(owner: Any) -> list[nn.Module]:
    """The models ``owner`` (a LightningModule) holds outside its module tree: its teachers', held
    directly or as the ``teacher`` of one of its attributes (with any output-layer copy). The memory
    estimate counts their tensors as weights."""
    found: list[nn.Module] = []
    for value in vars(owner).values():
        teacher = value if isinstance(value, Teacher) else getattr(value, "teacher", None)
        if isinstance(teacher, Teacher) and teacher.model is not None:
            found.append(teacher.model)
            if teacher._head_copy is not None:
                found.append(teacher._head_copy)
    return found
