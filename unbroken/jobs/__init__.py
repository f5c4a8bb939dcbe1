"""Built-in training jobs that `unbroken run` / `unbroken demo` launch."""
