"""How well a policy answers the shipped arithmetic prompts: greedy and sampled exact-answer rates.

    python scripts/eval_arithmetic.py runs/sft/tiny_cpu/export
    python scripts/eval_arithmetic.py runs/ppo/tiny_cpu/export --limit 512

Three numbers over the first ``--limit`` prompts:

- ``greedy_exact``: the share answered exactly with greedy decoding: what the model knows;
- ``sampled_exact``: the same when sampling at temperature 1, as the PPO rollouts do: what the
  PPO reward sees (the gap to greedy is the room PPO has from sharpening alone);
- ``answer_probability``: the mean probability the model gives the exact answer (its tokens and
  the end token, teacher-forced): the expected exact-answer reward of one sampled response,
  computed without sampling, so two models can be compared without sampling noise.

``--second-try`` adds the multi-turn demo's numbers (``configs/ppo/tiny_cpu_multi_turn.yaml``): one
sampled trajectory per prompt with :class:`recipes.environments.ArithmeticRetry` (a wrong answer gets
"Wrong. Try again." and a second answer), run by the recipe's multi-turn rollout: ``first_try_exact``,
``second_try_exact`` (right second answers over the wrong first ones) and ``two_try_score`` (the
environment's mean score: 1 for a right first answer, 0.5 for a right second one).

Prompts are rendered with the model's chat template exactly as the PPO recipe renders them, and
generated with the recipe's rollout engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

from lightning_mem.quiet import silence_unactionable_warnings  # noqa: E402

silence_unactionable_warnings()  # as the recipes do: library lines a user cannot act on stay out

from lightning_mem.data import collate_left_padded, encode_prompt, read_rows, row_to_prompt_messages  # noqa: E402
from lightning_mem.padding import pad_sequences  # noqa: E402
from lightning_mem.models import load_causal_lm, load_tokenizer  # noqa: E402
from lightning_mem.rl.rollout import (  # noqa: E402
    GenerationConfig,
    RolloutEngine,
    experience_from_generation,
    policy_forward,
)
from recipes.rewards import ExactAnswerReward  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "arithmetic" / "prompts.jsonl"


def evaluate(
    model_path: str, prompts: str | Path = DEFAULT_PROMPTS, *, limit: int = 256, max_new_tokens: int = 6,
    temperature: float = 1.0, batch_size: int = 64, seed: int = 0, second_try: bool = False,
) -> dict[str, float]:
    """``{"greedy_exact", "sampled_exact", "answer_probability", "prompts"}`` over the first ``limit``
    prompts; with ``second_try``, also the two-try numbers (module docstring)."""
    rows = read_rows(prompts)[:limit]
    if not rows:
        raise ValueError(f"{prompts}: no prompt rows")
    missing = [i + 1 for i, row in enumerate(rows) if "answer" not in row]
    if missing:
        raise KeyError(f"{prompts}: rows without an `answer` key (line {missing[0]} is the first)")
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path, dtype="float32").eval()
    items = []
    for row in rows:
        items.append({"prompt_ids": encode_prompt(row_to_prompt_messages(row), tokenizer), "row": row})
    eos = [tokenizer.eos_token_id]
    exact = ExactAnswerReward()  # the PPO config's reward
    result: dict[str, float] = {"prompts": float(len(rows))}
    torch.manual_seed(seed)
    for name, sample in (("greedy_exact", False), ("sampled_exact", True)):
        engine = RolloutEngine(
            GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=sample),
            eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id,
        )
        correct = 0.0
        for start in range(0, len(items), batch_size):
            batch = collate_left_padded(items[start : start + batch_size], tokenizer.pad_token_id)
            exp = engine.generate(model, batch["input_ids"], batch["attention_mask"])
            responses = [
                tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
                for ids, n in zip(exp.response_ids, exp.response_lengths)
            ]
            correct += sum(exact.score([], responses, batch["rows"]))
        result[name] = correct / len(rows)
    result["answer_probability"] = _answer_probability(model, tokenizer, items, temperature, batch_size)
    if second_try:
        result.update(_second_try(model, tokenizer, rows, max_new_tokens, temperature, batch_size))
    return result


def _second_try(model, tokenizer, rows, max_new_tokens: int, temperature: float, batch_size: int) -> dict[str, float]:
    """One sampled two-try trajectory per row (the multi-turn demo's environment and rollout)."""
    from lightning_mem.rl.multi_turn import MultiTurnConfig, multi_turn_rollout
    from recipes.environments import ArithmeticRetry

    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    engine = RolloutEngine(generation, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    rollout = multi_turn_rollout(lambda: ArithmeticRetry(tries=2, retry_discount=0.5),
                                 MultiTurnConfig(max_turns=2, max_total_tokens=256), tokenizer=tokenizer,
                                 generation=generation, engine=engine, eos_token_ids=[tokenizer.eos_token_id],
                                 pad_token_id=tokenizer.pad_token_id)
    scores = torch.cat([rollout.rollout(model, rows[start : start + batch_size]).scores
                        for start in range(0, len(rows), batch_size)])
    first, second, wrong = (scores == 1).sum(), (scores == 0.5).sum(), (scores < 1).sum()
    return {"first_try_exact": float(first) / len(rows), "second_try_exact": float(second) / max(int(wrong), 1),
            "two_try_score": float(scores.mean())}


@torch.no_grad()
def _answer_probability(model, tokenizer, items, temperature: float, batch_size: int) -> float:
    """Mean over prompts of P(answer tokens, then eos | prompt) at ``temperature``, teacher-forced:
    the right answer laid out as if the policy had generated it, scored by the recipe's logprob pass.

    The answer is tokenized on its own; that matches the chat template's rendering when the
    tokenizer does not merge across the assistant tag (true of the shipped tiny tokenizer: one
    token per digit).
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    total = 0.0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        batch = collate_left_padded(chunk, pad)
        answers = [
            tokenizer(str(item["row"]["answer"]).strip(), add_special_tokens=False)["input_ids"] + [eos] for item in chunk
        ]
        responses, _ = pad_sequences(answers, pad)
        exp = experience_from_generation(
            batch["input_ids"], batch["attention_mask"], torch.cat([batch["input_ids"], responses], dim=1),
            eos_token_ids=[eos], pad_token_id=pad,
        )
        logprobs = policy_forward(model, exp, temperature=temperature).logprobs
        total += float((logprobs * exp.response_mask).sum(dim=1).exp().sum())
    return total / len(items)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model directory (an SFT or PPO export) or hub id")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL rows with `prompt` and `answer`")
    parser.add_argument("--limit", type=int, default=256, help="evaluate the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0, help="for the sampled rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--second-try", action="store_true", help="also the multi-turn demo's two-try numbers")
    args = parser.parse_args(argv)
    result = evaluate(
        args.model, args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=args.seed, second_try=args.second_try,
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
