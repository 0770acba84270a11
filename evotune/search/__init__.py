"""The search: the loop, samplers and strategies, warm start, agents sharing a study, the static check."""
