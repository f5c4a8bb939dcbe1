"""Planning tools: measured wiring (topology), cost and memory models per strategy, `unbroken plan`."""
