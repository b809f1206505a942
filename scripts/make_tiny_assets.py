"""Make the shipped CPU assets: the arithmetic dataset in data/arithmetic/, the tiny
Llama-architecture model config + tokenizer in assets/tiny-llama/, and a smaller student of the same
tokenizer in assets/tiny-llama-student/ (half the width and half the blocks: what the SFT demo's
export teaches in configs/sft/tiny_cpu_distill.yaml).

Deterministic: running it again rewrites the same files byte for byte.

    python scripts/make_tiny_assets.py

The task is small-number arithmetic ("What is 12 + 7?" -> "19"): a few-million-parameter model
learns its format in seconds and its answers over minutes on CPU, and a rule can check every answer,
which is what the PPO recipe rewards.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data" / "arithmetic"
MODEL_DIR = ROOT / "assets" / "tiny-llama"
STUDENT_DIR = ROOT / "assets" / "tiny-llama-student"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

MAX_OPERAND = 20
SPECIAL_TOKENS = ["<|pad|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 512

# The whole chat format: a role tag line, the content, and <|eos|> closing each assistant turn.
# Rendering messages[:i] with add_generation_prompt=True is a prefix of rendering messages[:i+1],
# which is what masking the loss to assistant tokens relies on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|eos|>' }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

PHRASINGS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} =", "Calculate {a} {op} {b}."]


def make_problem(rng: random.Random) -> dict:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative: fewer tokens to learn
    answer = a + b if op == "+" else a - b
    return {"question": rng.choice(PHRASINGS).format(a=a, op=op, b=b), "answer": str(answer)}


def as_row(problem: dict, rng: random.Random) -> dict:
    # Both accepted row shapes ship, so both code paths run on every CPU run.
    if rng.random() < 0.5:
        messages = [
            {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": problem["answer"]},
        ]
        return {"messages": messages, "answer": problem["answer"]}
    return {"prompt": problem["question"], "completion": problem["answer"], "answer": problem["answer"]}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def make_data() -> list[str]:
    rng = random.Random(1234)
    train = [as_row(make_problem(rng), rng) for _ in range(4000)]
    val = [as_row(make_problem(rng), rng) for _ in range(200)]
    prompts = []
    for _ in range(512):
        p = make_problem(rng)
        prompts.append({"prompt": p["question"], "answer": p["answer"]})
    write_jsonl(DATA_DIR / "train.jsonl", train)
    write_jsonl(DATA_DIR / "val.jsonl", val)
    write_jsonl(DATA_DIR / "prompts.jsonl", prompts)
    texts = []
    for row in train:
        if "messages" in row:
            texts += [m["content"] for m in row["messages"]]
        else:
            texts += [row["prompt"], row["completion"]]
    return texts


def make_tokenizer(texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits stay single tokens so that arithmetic is learnable digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts + ["\n", "Hello, world! The quick brown fox."], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 256
    fast.save_pretrained(MODEL_DIR)


def make_config(folder: Path = MODEL_DIR, *, hidden: int = 256, intermediate: int = 688, layers: int = 4,
                heads: int = 8, kv_heads: int = 4) -> None:
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    if folder != MODEL_DIR:  # the same tokenizer files, byte for byte: a student speaks its teacher's tokens
        folder.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(MODEL_DIR / name, folder / name)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    config.save_pretrained(folder)


def main() -> None:
    texts = make_data()
    make_tokenizer(texts)
    make_config()
    make_config(STUDENT_DIR, hidden=128, intermediate=344, layers=2, heads=4, kv_heads=2)
    print(f"wrote {DATA_DIR}, {MODEL_DIR} and {STUDENT_DIR}")


if __name__ == "__main__":
    main()
