"""Rollout speed of the in-process (``hf``) engine, path by path, at the 24 GB PPO configs' shapes.

    python -m benchmarks.gpu.rollout_speed --out runs/gpu              # on a GPU: both 24 GB shapes
    python -m benchmarks.gpu.rollout_speed --shapes tiny               # the CPU counterpart (tiny model)
    python -m benchmarks.gpu.rollout_speed --shapes 1.5b --paths generate,static --new-tokens 8   # a CPU look at 1.5B

Each shape is a PPO config's rollout: the architecture from ``assets/hub`` at random (no weights on
a GPU machine without network), the config's dtype and LoRA, its rows (prompts x group) and
``max_new_tokens``, and prompts as long as ``data.max_prompt_length`` allows (random ids, left-padded
to lengths between 3/4 of it and all of it): the shape the estimate assumes and the tier runner
measured (docs/benchmarks.md, 2026-11-26). Each path is the engine as a YAML would set it:

- ``generate``: Hugging Face ``generate``, dynamic cache, adapters unmerged (the engine before issue 43);
- ``generate+merge``: the same with the LoRA adapters merged for the rollout;
- ``static``: the static decode loop (``kv_cache: static``), eager, adapters merged;
- ``static+compile``: the loop with its decode step compiled (``compile: true``; CUDA graphs on a GPU);
- ``static+compile-nomerge``: the compiled loop with the adapters left unmerged (merge's share);
- ``generate+ckpt``: ``generate`` with every decoder block wrapped for activation checkpointing, as the
  1.5B 24 GB config's callback leaves them (does the wrapper cost anything while sampling?).

A path runs once to warm up (for a compiled path that is the compile, timed apart), then
``--repeats`` times; the row gives generated tokens/s (response tokens up to the end token), the
time per decode step beside the memory-bound floor (weights plus the KV cache read once per step,
over ``--bandwidth``), and peak allocated above the weights. Rows go to ``$OUT/rollout_speed.md``
and ``.json``, each printed as it comes; a path that fails is a row that says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

PATHS = ("generate", "generate+merge", "static", "static+compile", "static+compile-nomerge", "generate+ckpt")


@dataclass
class Shape:
    """A PPO config's rollout: which model, how many rows and tokens."""

    model: str
    dtype: torch.dtype
    rows: int
    prompt_tokens: int
    new_tokens: int
    lora: bool
    paths: tuple[str, ...]


SHAPES = {
    # configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml: GRPO, LoRA r16 on 7 projections, 64 prompts x 8, 512 + 256.
    "0.5b": Shape("assets/hub/Qwen/Qwen2.5-0.5B-Instruct", torch.bfloat16, 512, 512, 256, True,
                  ("generate", "static+compile", "static", "generate+merge", "static+compile-nomerge")),
    # configs/ppo/qwen2.5-1.5b-instruct_1x24gb.yaml: GAE, full weights, activation checkpointing, 64 prompts, 1024 + 256.
    "1.5b": Shape("assets/hub/Qwen/Qwen2.5-1.5B-Instruct", torch.bfloat16, 64, 1024, 256, False,
                  ("generate", "static+compile", "static", "generate+ckpt")),  # ckpt last: it wraps the blocks for good
    # The CPU counterpart: the tiny Llama, fp32.
    "tiny": Shape("assets/tiny-llama", torch.float32, 64, 48, 32, True,
                  ("generate", "generate+merge", "static", "static+compile")),
}


def build_model(shape: Shape, device: str) -> torch.nn.Module:
    from lightning_mem.lora import LoraSettings, apply_lora
    from lightning_mem.models import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(str(ROOT / shape.model), dtype=shape.dtype, attn_implementation="sdpa").to(device)
    if shape.lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = apply_lora(model, LoraSettings(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        for name, param in model.named_parameters():  # B = 0 at init would make merging a no-op
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
    return model.eval()


def prompts(shape: Shape, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    width = shape.prompt_tokens
    lengths = torch.randint(max(1, 3 * width // 4), width + 1, (shape.rows,), generator=g)
    ids = torch.randint(10, min(vocab, 30000), (shape.rows, width), generator=g)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def engine_for(path: str, shape: Shape) -> RolloutEngine:
    static = path.startswith("static")
    gen = GenerationConfig(max_new_tokens=shape.new_tokens, temperature=1.0, kv_cache="static" if static else "dynamic",
                           compile="compile" in path, merge_lora=path != "generate" and "nomerge" not in path)
    # A random model's ends of sequence come rarely: id 0 ends nothing here, so every row runs full length.
    return RolloutEngine(gen, eos_token_ids=[1], pad_token_id=0)


def floor_ms(model: torch.nn.Module, shape: Shape, bandwidth: float) -> float:
    """Bytes one decode step must read (every weight once, the KV cache at its mean length), over bandwidth."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(shape.dtype).bits // 8
    mean_context = shape.prompt_tokens + shape.new_tokens / 2
    return 1e3 * (weights + shape.rows * mean_context * kv_per_token) / bandwidth


def measure(path: str, shape: Shape, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
            repeats: int) -> dict[str, Any]:
    cuda = ids.is_cuda
    engine = engine_for(path, shape)
    if path == "generate+ckpt":
        from lightning_mem.activation_checkpointing import checkpoint_blocks

        checkpoint_blocks(model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], []
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        exp = engine.generate(model, ids, mask)
        sync()
        times.append(time.perf_counter() - start)
        tokens.append(int(exp.response_mask.sum()))
    engine.close()
    timed = times[1:]
    seconds = statistics.median(timed)
    return {"path": path, "warmup_s": times[0], "median_s": seconds, "tokens": tokens[-1],
            "tokens_per_s": tokens[-1] / seconds, "step_ms": 1e3 * seconds / shape.new_tokens,
            "peak_above_weights_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None}


def row(shape_name: str, shape: Shape, result: dict[str, Any], floor: float) -> str:
    if "error" in result:
        return f"| {shape_name} | {result['path']} | error: {result['error']} | | | | |"
    peak = result["peak_above_weights_gib"]
    return (f"| {shape_name} ({shape.rows} x {shape.prompt_tokens}+{shape.new_tokens}) | {result['path']} "
            f"| {result['tokens_per_s']:,.0f} | {result['step_ms']:.1f} ({result['step_ms'] / floor:.1f}x floor {floor:.2f}) "
            f"| {result['warmup_s']:.1f} | {'n/a' if peak is None else f'{peak:.2f}'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu")
    parser.add_argument("--shapes", default=None, help="comma-separated of " + ", ".join(SHAPES) + " (default: 0.5b,1.5b on a GPU, tiny on CPU)")
    parser.add_argument("--paths", default=None, help="comma-separated subset of " + ", ".join(PATHS))
    parser.add_argument("--new-tokens", type=int, default=None, help="override each shape's max_new_tokens")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the floor (H100 SXM: 3.35e12)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = (args.shapes or ("0.5b,1.5b" if device == "cuda" else "tiny")).split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| shape | path | generated tokens/s | ms per decode step (vs floor) | warm-up s | peak above weights GiB |",
             "|---|---|---|---|---|---|"]
    results = []
    for name in names:
        shape = SHAPES[name]
        if args.new_tokens:
            shape.new_tokens = args.new_tokens
        paths = [p for p in shape.paths if args.paths is None or p in args.paths.split(",")]
        model = build_model(shape, device)
        ids, mask = prompts(shape, model.config.vocab_size, device)
        floor = floor_ms(model, shape, args.bandwidth)
        for path in paths:
            try:
                result = measure(path, shape, model, ids, mask, args.repeats)
            except Exception as err:  # noqa: BLE001 - a failing path is a row, and the others still run
                result = {"path": path, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
            result["shape"] = name
            results.append(result)
            lines.append(row(name, shape, result, floor))
            print(lines[-1], flush=True)
            write(out, device, lines, results)  # after every row: a run stopped at its limit keeps what it measured
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(lines))


def write(out: Path, device: str, lines: list[str], results: list[dict[str, Any]]) -> None:
    import transformers

    header = (f"Rollout speed, {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'},"
              f" torch {torch.__version__}, transformers {transformers.__version__}")
    (out / "rollout_speed.md").write_text(header + "\n\n" + "\n".join(lines) + "\n")
    (out / "rollout_speed.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
