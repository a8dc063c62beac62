"""Ring attention: a kernel-agnostic loop over K/V blocks with an exact LSE merge."""
