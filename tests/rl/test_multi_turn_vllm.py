"""Multi-turn rollouts on the vLLM engine: each turn's request is the trajectory's buffer as token
ids (the prompt, every turn as sampled, every observation as rendered), never re-tokenized text,
and the engine's log-probs of its tokens follow them into the trajectory.

vLLM need not be installed: a stand-in ``vllm`` module (``LLM``, ``SamplingParams``,
``inputs.TokensPrompt``) serves :class:`~lightning_mem.rl.vllm_engine.VLLMRolloutEngine`. Its
``LLM.generate`` decodes greedily with the tiny model from the token ids it is handed and records
them, so the engine's own code (requests, stop tokens, log-probs, padding) runs as it does on vLLM.
The real engine's tests (``-m vllm``, ``.venv-vllm``) hold vLLM's greedy decode equal to this one.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.multi_turn import MultiTurnConfig, multi_turn_rollout
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine
from tests.helpers import TINY_MODEL
from tests.rl.test_multi_turn import EOS, PAD, ROWS, Uneven

GREEDY = GenerationConfig(max_new_tokens=5, do_sample=False)


class StandInLLM:
    """``vllm.LLM.generate`` on token-id prompts: greedy, stops on ``stop_token_ids``, each sampled
    token's log-prob as vLLM reports it (``logprobs=0``: a dict holding the sampled token)."""

    def __init__(self, model) -> None:
        self.model, self.requests = model, []

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            self.requests.append(ids)
            assert p.kwargs["temperature"] == 0.0 and p.kwargs["detokenize"] is False
            tokens, logprobs = [], []
            for _ in range(p.kwargs["max_tokens"]):
                logits = self.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].float()
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append({token: SimpleNamespace(logprob=float(logits.log_softmax(-1)[token]))})
                if token in p.kwargs["stop_token_ids"]:
                    break
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)]))
        return outputs


@pytest.fixture
def stand_in_vllm(monkeypatch):
    import importlib.machinery

    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # found, as an installed vLLM is
    vllm.SamplingParams = lambda **kwargs: SimpleNamespace(kwargs=kwargs)
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def _rollout(engine, tokenizer):
    return multi_turn_rollout(Uneven, MultiTurnConfig(max_turns=3), tokenizer=tokenizer, generation=GREEDY, engine=engine,
                              eos_token_ids=[EOS], pad_token_id=PAD)


def test_vllm_continues_each_trajectory_from_its_token_ids(stand_in_vllm):
    from lightning_mem.rl.vllm_engine import VLLMRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = load_causal_lm(str(TINY_MODEL))
    engine = VLLMRolloutEngine(GREEDY, RolloutEngineConfig(name="vllm"), model_path=str(TINY_MODEL),
                               eos_token_ids=[EOS], pad_token_id=PAD)
    rollout = _rollout(engine, tokenizer)
    assert engine.prefix_caching  # turn k's request starts with turn k-1's: vLLM prefills only the new ids
    engine.llm = StandInLLM(model)
    exp = rollout.rollout(model, ROWS)

    # The same trajectories as the hf engine continuing its cache, token for token.
    hf = _rollout(RolloutEngine(GREEDY, eos_token_ids=[EOS], pad_token_id=PAD), tokenizer).rollout(model, ROWS)
    for name in ("input_ids", "attention_mask", "response_ids", "response_mask", "scores"):
        assert torch.equal(getattr(exp, name), getattr(hf, name)), name
    assert exp.response_mask.sum(1).gt(0).all() and hf.engine_logprobs is None

    # Each request is a trajectory's buffer up to the turn it asks for: its prompt, then every sampled
    # id and observation id as they sit in the buffer (3 + 1 + 2 + 3 turns over the 4 rows).
    buffers = [row[m.bool()].tolist() for row, m in zip(exp.input_ids, exp.attention_mask)]
    turn_starts = [[exp.prompt_lengths[i].item() + j for j in range(exp.response_mask.shape[1])
                    if exp.response_mask[i, j] and (j == 0 or not exp.response_mask[i, j - 1])] for i in range(len(ROWS))]
    expected = [buffers[i][:start] for k in range(3) for i in range(len(ROWS)) if len(turn_starts[i]) > k
                for start in [turn_starts[i][k]]]
    assert engine.llm.requests == expected
    # Decoding a buffer and encoding the text again gives other ids: what re-tokenizing would have sent.
    assert any(tokenizer(tokenizer.decode(b), add_special_tokens=False)["input_ids"] != b for b in buffers)

    # The engine's log-probs sit on its sampled ids (0 on prompts' and observations' columns) and are
    # the model's own there.
    logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits.float()
    for i, start in enumerate(exp.prompt_lengths.tolist()):
        mask = exp.response_mask[i].bool()
        columns = mask.nonzero()[:, 0]
        want = logits[i, start - 1 + columns].log_softmax(-1).gather(-1, exp.response_ids[i, columns, None])[:, 0]
        torch.testing.assert_close(exp.engine_logprobs[i][mask], want, atol=1e-5, rtol=0)
        assert exp.engine_logprobs[i][~mask].abs().sum() == 0
