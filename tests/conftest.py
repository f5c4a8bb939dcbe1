"""Suite-wide settings: hypothesis runs derandomized, so CI sees the same examples every run."""
from hypothesis import settings

settings.register_profile("unbroken", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("unbroken")
