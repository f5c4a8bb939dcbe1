"""Reward functions for the RL CLI tests: one that raises, one that returns a non-number."""


def raises(prompt, completion):
    raise ZeroDivisionError("bad reward")


def not_a_number(prompt, completion):
    return "1.0"
