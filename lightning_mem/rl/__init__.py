"""RLHF building blocks: PPO/GRPO arithmetic, rollouts, critic, rewards, micro-batching, and the
per-phase memory plan. The PPO recipe (``recipes/ppo.py``) composes them."""
