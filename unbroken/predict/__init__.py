"""Predict LLM inference power and inter-token latency on GPUs and models nobody has profiled.

An application over public data: spec tables (`tables`), public measurements in one schema
(`measurements`), WattGPU's features (`features`), XGBoost with conformal intervals (`models`),
baselines (`baselines`), held-out evaluation (`evaluate`) and the user-facing `service`.
It uses no part of unbroken's core.
"""
