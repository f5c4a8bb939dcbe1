"""Elastic RL post-training: a verifiable task, a tiny GPT policy trained with GRPO, rollout and
training pools as processes, and a controller that moves processes between the pools at run time."""
